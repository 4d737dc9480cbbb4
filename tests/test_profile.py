"""`fp8stack profile`: the kernel classifier on real kernel names, the Amdahl bound, and a CPU run."""

import contextlib
import json
import weakref
from pathlib import Path

import pytest

from fp8stack.evidence import run_folder
from fp8stack.cli import build_parser
from fp8stack.config import parse_args
from fp8stack.profile import (CATEGORIES, GAP_MIN_US, Gap, HostOp, RunProfile, amdahl_bound, classify, family_ms,
                              idle_gaps, kernel_family, main, measured_gain, quantize_overhead, run_profile,
                              top_host_ops)


def _evidence(out_dir: Path, name: str) -> Path:
    """Where this process's run writes the evidence file `name` under out_dir: its run folder."""
    return run_folder(name.rsplit(".", 1)[0], out_dir) / name

KERNELS = {
    # cuBLAS / cuBLASLt / CUTLASS GEMMs, FP8 ones included (their operand types must not make them 'quantize')
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
    "execute_segment_k_off_kernel__5x_cublas": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "gemm",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
    "cutlass::float_e4m3_t, cutlass::float_e4m3_t> >(...)": "gemm",
    "void deep_gemm::fp8_gemm_kernel<128u, 128u>(__nv_bfloat16*, float*, int*, unsigned int)": "gemm",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::_scaled_mm": "gemm",
    "aten::_grouped_mm": "gemm",
    # attention: flash, PyTorch's flash and memory-efficient kernels, cuDNN SDPA, CPU SDPA
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t> >":
        "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128> >(...)":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x128_4x1x1_kernel0_0": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    # FP8 casts and scales: TE, torchao (compiled and eager), MXFP8
    "void transformer_engine::detail::cast_transpose_kernel<8ul, 4ul, float, __nv_bfloat16, "
    "__nv_fp8_e4m3>(...)": "quantize",
    "void transformer_engine::delayed_scaling_recipe::kernel::amax_and_scale_update_kernel(...)": "quantize",
    "void transformer_engine::dispatch::mxfp8::quantize_kernel<false, false, false, float, __nv_bfloat16>(...)":
        "quantize",
    "triton_red_fused_abs_amax_0": "quantize",
    "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda(float)#1}, c10::Float8_e4m3fn>(...)": "quantize",
    "_ToFloat8ConstrFunc": "quantize",
    # norms, elementwise, communication, the rest
    "void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<...>(...)": "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norm",
    "aten::_fused_rms_norm": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)":
        "elementwise",
    "triton_poi_fused_mul_silu_2": "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "elementwise",
    "aten::copy_": "elementwise",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(...)": "communication",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::Epilogue>":
        "other",
    "Memcpy HtoD (Pageable -> Device)": "other",
    "aten::embedding_dense_backward": "other",
}


@pytest.mark.parametrize(("name", "category"), KERNELS.items(), ids=[n[:40] for n in KERNELS])
def test_classifier_on_real_kernel_names(name, category):
    assert classify(name) == category


def test_measured_gemm_speedup_counts_the_bf16_gemms_at_their_bf16_time():
    from fp8stack.profile import measured_gemm_speedup

    assert measured_gemm_speedup(100.0, 60.0, 0.8) == pytest.approx(80 / 40)  # 20 ms stay BF16: 80 ms became 40
    assert measured_gemm_speedup(100.0, 100.0, 1.0) == pytest.approx(1.0)
    assert measured_gemm_speedup(100.0, 15.0, 0.8) is None  # less than the BF16 GEMMs alone: not a speed-up


def test_amdahl_bound():
    assert amdahl_bound(0.30, 1.0, 2.0) == pytest.approx(1.18, abs=0.005)  # GEMMs at 30% -> at most 1.18x
    assert amdahl_bound(0.30, 1.0, 2.0) == pytest.approx(1 / 0.85)
    assert amdahl_bound(1.0, 1.0, 2.0) == pytest.approx(2.0)  # all GEMM: the GEMM speed-up itself
    assert amdahl_bound(0.6, 0.0, 2.0) == 1.0  # nothing in FP8: no gain
    assert amdahl_bound(0.6, 0.5, 2.0) == pytest.approx(1 / (1 - 0.3 + 0.15))


def test_idle_gaps_count_time_with_no_kernel_on_any_stream():
    kernels = [("gemm", 0.0, 100.0), ("copy", 10.0, 150.0),  # overlapping streams: busy until 150
               ("norm", 400.0, 450.0),  # 250 us idle after copy, the latest-ending kernel
               ("add", 455.0, 460.0),  # 5 us: launch latency, idle but not listed
               ("gemm", 1000.0, 1100.0), ("copy", 1010.0, 1150.0), ("norm", 1400.0, 1450.0)]  # the pattern again
    idle_ms, gaps = idle_gaps(kernels, steps=2)
    assert idle_ms == pytest.approx((250 + 5 + 540 + 250) / 2 / 1000)
    assert [(g.previous_kernel, g.next_kernel) for g in gaps] == [("add", "gemm"), ("copy", "norm")]
    assert gaps[1].ms_per_step == pytest.approx(250 / 1000) and gaps[1].count_per_step == 1
    assert all(g.ms_per_step * 1000 >= GAP_MIN_US for g in gaps)
    assert idle_gaps([], steps=1) == (0.0, [])


def _ab_json(path, arms, reference="bf16"):
    """An A/B evidence file's arms: tokens/s by arm, `reference` the baseline's verdict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"arms": [{"recipe": r, "tokens_per_s": t, "verdict": "baseline" if r == reference
                                          else "ship"} for r, t in arms.items()]}))


def test_measured_gain_reads_the_ab_evidence(tmp_path):
    ab = tmp_path / "ab-tiny-cpu.json"
    assert measured_gain(ab, "tensorwise") is None  # no A/B yet
    _ab_json(ab, {"bf16": 1000.0, "tensorwise": 1250.0, "rowwise": None})
    assert measured_gain(ab, "tensorwise") == pytest.approx(1.25)
    assert measured_gain(ab, "rowwise") is None  # the arm failed
    assert measured_gain(ab, "blockwise") is None  # not an arm
    _ab_json(ab, {"bf16": 1000.0, "bf16 on te": 1100.0, "tensorwise": 1375.0}, reference="bf16 on te")
    assert measured_gain(ab, "tensorwise") == pytest.approx(1.25)  # over the reference, the fastest BF16 arm


def test_profile_tiny_on_cpu_writes_the_evidence(tmp_path, capsys):
    _ab_json(_evidence(tmp_path, "ab-tiny-gb4-cpu.json"), {"bf16": 1000.0, "tensorwise": 900.0})  # the label's A/B
    code = main(["--model", "tiny", "--fp8-recipe", "tensorwise", "--steps", "2", "--profile.warmup-steps", "1",
                 "--micro-batch", "2", "--global-batch-size", "4", "--seq-len", "64", "--device", "cpu",
                 "--label", "gb4", "--out-dir", str(tmp_path)])
    assert code == 0
    record = json.loads(_evidence(tmp_path, "profile-tiny-gb4-cpu.json").read_text())
    assert record["train_config"]["training"]["global_batch"] == 4 and record["warmup"] == 1
    assert {"date", "command", "environment", "runs", "amdahl_bound", "gemm_share"} <= set(record)
    assert list(record["runs"]) == ["bf16", "tensorwise"]  # the bf16 profile gives the GEMM share
    for run in record["runs"].values():
        assert list(run["categories"]) == list(CATEGORIES)
        assert sum(c["share"] for c in run["categories"].values()) == pytest.approx(1.0)
        assert run["categories"]["gemm"]["share"] > 0.05 and run["wall_ms_per_step"] > 0
        assert 0 < len(run["top_kernels"]) <= 30
        times = [k["ms_per_step"] for k in run["top_kernels"]]
        assert times == sorted(times, reverse=True)
        assert run["idle_ms_per_step"] is None and run["gaps"] is None  # CPU ops nest: no gaps to read
    kernels = {k["name"]: k["category"] for k in record["runs"]["tensorwise"]["top_kernels"]}
    assert kernels["aten::mm"] == "gemm"
    assert record["runs"]["bf16"]["categories"]["quantize"]["share"] == 0.0
    assert record["runs"]["tensorwise"]["categories"]["quantize"]["share"] > 0  # torchao's casts and scales
    s, f = record["gemm_share"], record["fp8_share_of_gemm_flops"]
    assert s == record["runs"]["bf16"]["categories"]["gemm"]["share"] and 0.9 < f <= 1.0
    assert record["amdahl_bound"] == pytest.approx(amdahl_bound(s, f, 2.0)) and record["amdahl_bound"] > 1.0
    assert record["quantize_over_gemm"] > 0
    # the bf16 run shares no family with torchao's casts: the overhead is all of it
    assert record["quantize_overhead_over_gemm"] == pytest.approx(record["quantize_over_gemm"])
    assert record["quantize_fused_families"] == []
    assert set(record["runs"]["tensorwise"]["family_ms"]) <= set(CATEGORIES)
    assert record["measured_gain"] == pytest.approx(0.9)
    out = capsys.readouterr().out
    assert "Amdahl bound on tensorwise's gain" in out and "measured (A/B tokens/s over bf16): 0.90x" in out
    markdown = _evidence(tmp_path, "profile-tiny-gb4-cpu.md").read_text()
    assert markdown.count("| aten::mm | gemm |") == 1
    # the host's side, from the same record: on a CPU its ops are the kernels, the GEMM first among them
    host = {op["name"]: op for op in record["runs"]["tensorwise"]["host_ops"]}
    mm = {k["name"]: k for k in record["runs"]["tensorwise"]["top_kernels"]}["aten::mm"]
    assert (host["aten::mm"]["self_ms_per_step"], host["aten::mm"]["calls_per_step"]) == (mm["ms_per_step"],
                                                                                          mm["calls_per_step"])
    selfs = [op["self_ms_per_step"] for op in record["runs"]["tensorwise"]["host_ops"]]
    assert selfs == sorted(selfs, reverse=True) and len(selfs) <= 20
    host_table = markdown.split("Host: top ops by self CPU time per step in tensorwise")[1]
    assert "| op | self CPU ms/step | calls/step |" in host_table and "| aten::mm |" in host_table


def test_the_host_table_ranks_cpu_ops_and_ranges_per_step_without_the_whole_step():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, self_us, count, device=DeviceType.CPU):
        return SimpleNamespace(key=key, self_cpu_time_total=self_us, count=count, device_type=device)

    averages = [event("ProfilerStep#4", 9e6, 1), event("ProfilerStep#5", 9e6, 1),  # the whole step: left out
                event("aten::copy_", 3000.0, 4000), event("Optimizer.step#AdamW.step", 1500.0, 2),
                event("void gemm_kernel<...>", 8e6, 8, DeviceType.CUDA),  # a kernel: the GPU's, not the host's
                event("cudaLaunchKernel", 2000.0, 6000), event("load_batch#7", 400.0, 1),
                event("load_batch#8", 200.0, 1)]
    ops = top_host_ops(averages, steps=2)
    assert [(op.name, op.self_ms_per_step, op.calls_per_step) for op in ops] == [
        ("aten::copy_", 1.5, 2000), ("cudaLaunchKernel", 1.0, 3000), ("Optimizer.step#AdamW.step", 0.75, 1),
        ("load_batch", 0.3, 1)]
    many = [event(f"aten::op{i}", float(i), 1) for i in range(50)]
    assert [op.name for op in top_host_ops(many, steps=1)] == [f"aten::op{i}" for i in range(49, 29, -1)]


def test_committed_profiles_written_before_the_host_table_still_read():
    """RunProfile.from_dict on every profile evidence file in profiles/runs: older ones lack host_ops (and the oldest
    family_ms), which read as None."""
    files = sorted((Path(__file__).resolve().parents[1] / "profiles" / "runs").glob("*/profile-*.json"))
    assert files, "no committed profile evidence to read"
    for path in files:
        for recipe, run in json.loads(path.read_text())["runs"].items():
            profiled = RunProfile.from_dict(run)
            assert profiled.recipe == recipe and profiled.top_kernels[0].name == run["top_kernels"][0]["name"]
            assert profiled.host_ops is None or isinstance(profiled.host_ops[0], HostOp)
            assert profiled.gaps is None or all(isinstance(gap, Gap) for gap in profiled.gaps)


def test_profile_subcommand_is_wired_into_the_cli(capsys):
    args = parse_args(build_parser(), ["profile", "--model", "tiny", "--fp8-recipe", "rowwise", "--compile",
                                       "--steps", "7", "--profile.warmup-steps", "2"])
    assert args.run is run_profile
    assert (getattr(args, "precision.recipe"), getattr(args, "training.compile")) == ("rowwise", True)
    assert (getattr(args, "profile.steps"), getattr(args, "profile.warmup_steps")) == (7, 2)
    assert main(["--fp8-recipe", "tensorwise", "--steps", "0", "--out-dir", "unused"]) == 2
    assert "need --profile.steps >= 1" in capsys.readouterr().err
    assert main(["--fp8-recipe", "tensorwise", "--profile.warmup-steps", "-1", "--out-dir", "unused"]) == 2
    assert "--profile.warmup-steps >= 0" in capsys.readouterr().err
    # the FP8 run takes one --blockwise-gemms library, which the blockwise recipe needs
    assert main(["--fp8-recipe", "blockwise", "--blockwise-gemms", "te,deepgemm", "--out-dir", "unused"]) == 2
    assert "--blockwise-gemms: invalid choice: 'te,deepgemm'" in capsys.readouterr().err
    assert main(["--fp8-recipe", "delayed", "--blockwise-gemms", "deepgemm", "--out-dir", "unused"]) == 2
    assert "use --fp8-recipe blockwise or drop --te.blockwise-gemms" in capsys.readouterr().err
    assert main(["--fp8-recipe", "delayed", "--param-dtype", "bf16,fp8", "--out-dir", "unused"]) == 2
    assert "--param-dtype: invalid choice: 'bf16,fp8'" in capsys.readouterr().err


def test_fp8_parameters_are_profiled_against_bf16_ones(monkeypatch):
    """A BF16 plan has no FP8 weights (the trainer refuses fp8 parameters for it), so the bf16 run takes bf16."""
    profiled = []

    class Stop(Exception):
        pass

    def record(cfg, warmup, steps):  # the configurations profile runs, without TE's CUDA runs
        profiled.append((cfg.precision.recipe, cfg.training.param_dtype))
        if cfg.precision.recipe != "bf16":
            raise Stop
        return None, None

    monkeypatch.setattr("fp8stack.profile.profile_run", record)
    with pytest.raises(Stop):
        main(["--model", "tiny", "--fp8-recipe", "delayed", "--backend", "te", "--param-dtype", "fp8",
              "--dtype", "bf16", "--out-dir", "unused"])
    assert profiled == [("bf16", "bf16"), ("delayed", "fp8")]


def test_the_fp8_dispatch_is_profiled_against_the_bf16_dispatch(monkeypatch):
    """The bf16 run has no FP8 experts to dispatch to or lay out wgrad operands for (its plan would refuse the
    options): it drops the FP8 dispatch, the compiled wgrad layout and TE's expert quantizer."""
    profiled = []

    class Stop(Exception):
        pass

    def record(cfg, warmup, steps):
        profiled.append((cfg.precision.recipe, cfg.grouped_fp8.fp8_dispatch, cfg.grouped_fp8.wgrad_flatten,
                         cfg.grouped_fp8.quantizer))
        raise Stop

    monkeypatch.setattr("fp8stack.profile.profile_run", record)
    with pytest.raises(Stop):
        main(["--model", "tiny-moe", "--fp8-recipe", "blockwise", "--expert-backend", "grouped_fp8",
              "--grouped-fp8.fp8-dispatch", "--grouped-fp8.wgrad-flatten", "compiled", "--grouped-fp8.quantizer", "te",
              "--out-dir", "unused"])
    assert profiled == [("bf16", False, "auto", "auto")]


def test_quantize_overhead_counts_fused_kernels_by_their_excess_over_bf16():
    """TE's SwiGLU kernels write FP8 in the FP8 run (quantize) and BF16 in the bf16 run (elementwise): the same
    family, whose BF16 time is work FP8 did not add. Pure casts count whole."""
    fp8 = family_ms([("void transformer_engine::gated_act_kernel<16, true, float, __nv_fp8_e4m3>(int)", 7.7),
                     ("void transformer_engine::dgated_act_kernel<16, true, float, __nv_fp8_e5m2>(int)", 9.9),
                     ("cast_transpose_optimized_kernel(__nv_bfloat16 const*, __nv_fp8_e5m2*)", 4.2)])
    bf16 = family_ms([("void transformer_engine::gated_act_kernel<16, true, float, __nv_bfloat16>(int)", 5.8),
                      ("void transformer_engine::dgated_act_kernel<16, true, float, __nv_bfloat16>(int)", 10.5)])
    assert kernel_family("void transformer_engine::gated_act_kernel<16, true>(int)") == \
        "transformer_engine::gated_act_kernel"
    assert fp8["quantize"] == {"transformer_engine::gated_act_kernel": 7.7,
                               "transformer_engine::dgated_act_kernel": 9.9, "cast_transpose_optimized_kernel": 4.2}
    overhead, fused = quantize_overhead(21.8, fp8, bf16)
    # gated: 7.7 - 5.8 counts; dgated: faster than its BF16 counterpart, counts 0; the cast counts whole
    assert overhead == pytest.approx(1.9 + 0.0 + 4.2)
    assert [f["family"] for f in fused] == ["transformer_engine::gated_act_kernel",
                                            "transformer_engine::dgated_act_kernel"]


def test_each_profiled_run_starts_after_the_one_before_it_is_freed(tmp_path, monkeypatch):
    """The BF16 run's model (held in a cycle with its master weights through hooks) is gone before the FP8 run
    builds its own: on a GPU both would not fit at deepseek-moe-medium."""
    from fp8stack.train import loop

    earlier, real_session = [], loop.session

    @contextlib.contextmanager
    def watched(cfg):
        with real_session(cfg) as run:
            assert all(model() is None for model in earlier), "the previous profiled run's model is still alive"
            earlier.append(weakref.ref(run.model))
            yield run

    monkeypatch.setattr(loop, "session", watched)
    code = main(["--model", "tiny", "--fp8-recipe", "tensorwise", "--steps", "1", "--profile.warmup-steps", "0",
                 "--micro-batch", "2", "--global-batch-size", "4", "--seq-len", "64", "--device", "cpu",
                 "--param-dtype", "bf16", "--dtype", "bf16", "--out-dir", str(tmp_path)])
    assert code == 0 and len(earlier) == 2


def test_a_recipe_files_overrides_go_to_the_fp8_run_and_the_bf16_run_stays_without_fp8(monkeypatch):
    profiled = []

    class Stop(Exception):
        pass

    def record(cfg, warmup, steps):
        profiled.append((cfg.precision.recipe, len(cfg.precision.overrides)))
        if cfg.precision.recipe != "bf16":
            raise Stop
        return None, None

    monkeypatch.setattr("fp8stack.profile.profile_run", record)
    with pytest.raises(Stop):
        main(["--model", "tiny-moe", "--recipe-file", "moe-only-fp8", "--out-dir", "unused"])
    assert profiled == [("bf16", 0), ("blockwise", 2)]
