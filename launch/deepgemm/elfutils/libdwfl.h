// The declarations of elfutils' <elfutils/libdwfl.h> that DeepJIT's exception.hpp uses (libdw-dev is not
// installed on the GPU machine). DeepJIT dlopens libdw.so.1 at run time and only symbolizes stack traces with it.
#pragma once
#include <cstdint>
#include <elf.h>
#include <sys/types.h>

typedef uint64_t Dwarf_Addr;
typedef uint64_t Dwarf_Word;
typedef Elf64_Addr GElf_Addr;
typedef Elf64_Word GElf_Word;
typedef Elf64_Shdr GElf_Shdr;
typedef struct Elf Elf;
typedef struct Dwfl Dwfl;
typedef struct Dwfl_Module Dwfl_Module;
typedef struct Dwfl_Line Dwfl_Line;

typedef struct {
    int (*find_elf)(Dwfl_Module*, void**, const char*, Dwarf_Addr, char**, Elf**);
    int (*find_debuginfo)(Dwfl_Module*, void**, const char*, Dwarf_Addr, const char*, const char*, GElf_Word, char**);
    int (*section_address)(Dwfl_Module*, void**, const char*, Dwarf_Addr, const char*, GElf_Word, const GElf_Shdr*,
                           Dwarf_Addr*);
    char** debuginfo_path;
} Dwfl_Callbacks;

extern "C" {
Dwfl* dwfl_begin(const Dwfl_Callbacks* callbacks);
int dwfl_linux_proc_report(Dwfl* dwfl, pid_t pid);
int dwfl_report_end(Dwfl* dwfl, int (*removed)(Dwfl_Module*, void*, const char*, Dwarf_Addr, void*), void* arg);
Dwfl_Module* dwfl_addrmodule(Dwfl* dwfl, Dwarf_Addr address);
const char* dwfl_module_addrname(Dwfl_Module* mod, GElf_Addr address);
Dwfl_Line* dwfl_module_getsrc(Dwfl_Module* mod, Dwarf_Addr addr);
const char* dwfl_lineinfo(Dwfl_Line* line, Dwarf_Addr* addr, int* linep, int* colp, Dwarf_Word* mtime,
                          Dwarf_Word* length);
int dwfl_linux_proc_find_elf(Dwfl_Module* mod, void** userdata, const char* module_name, Dwarf_Addr base,
                             char** file_name, Elf** elfp);
}
