"""A model_provider for Megatron-LM's pretrain_gpt.py that builds the GPTModel through fp8stack's block factory.

Megatron's own --fp8* flags keep their meaning: plan_from_megatron_args reads them off the TransformerConfig
(--fp8-format, --fp8-recipe, --first-last-layers-bf16, --num-layers-at-{start,end}-in-bf16) and makes
fp8stack's plan; block_spec then gives every decoder layer (and every GEMM whose decision differs from its
layer's) the FP8 context the plan says. Everything else is Megatron-LM's gpt_builder: the same GPTModel
arguments, read from the same args.

Hooking it into a Megatron-LM checkout (with this folder on PYTHONPATH), in pretrain_gpt.py:

    from fp8stack_model_provider import gpt_builder             # instead of: from gpt_builders import gpt_builder
    pretrain(..., partial(model_provider, gpt_builder), ...)    # unchanged

or, for a pretrain_gpt.py whose model_provider(pre_process, post_process, vp_stage) builds the model itself,
pass this module's model_provider to pretrain() (the file's name keeps clear of
Megatron-LM's own model_provider.py). Then the usual launch runs fp8stack's plan:

    torchrun ... pretrain_gpt.py --fp8-format hybrid --fp8-recipe delayed --transformer-impl transformer_engine ...

examples/megatron/train.py builds the same model through build_gpt_model and trains it with megatron-core's
own schedule, DDP and optimizer, without Megatron-LM.
"""

import torch

from fp8stack.megatron import block_spec, plan_from_megatron_args
from fp8stack.plan import Plan, PlanError


def plan_for(args, config) -> Plan:
    """fp8stack's plan for the model `args` and `config` describe: megatron's FP8 flags as config carries them."""
    arch = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    return plan_from_megatron_args(config, vocab_size=args.padded_vocab_size, seq_len=args.seq_length,
                                   moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
                                   **({"arch": arch} if arch is not None else {}))


def build_gpt_model(args, config, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                    pg_collection=None, use_te: bool | None = None, spec=None):
    """Megatron-LM's GPTModel for `args` (Megatron-LM's parsed arguments, or any object with the same attribute
    names) and `config` (its TransformerConfig), its decoder layers from block_spec(config, plan_for(args, config)).

    use_te: as block_spec's (None: TransformerEngine when it imports and CUDA is visible; without it the
    plan must be BF16, which a launch without --fp8-format makes).
    spec: the decoder layers' ModuleSpec instead of block_spec's (train.py's --layer-spec megatron passes megatron's
    own TE spec, to compare with the model Megatron-LM builds)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if getattr(args, "mtp_num_layers", None):
        raise PlanError("--mtp-num-layers: this model_provider builds no multi-token-prediction block; drop the flag "
                        "or use Megatron-LM's gpt_builder")
    if getattr(args, "spec", None):
        raise PlanError(f"--spec {' '.join(args.spec)}: fp8stack's block_spec builds the layer specs; drop the flag")
    if spec is None:
        spec = block_spec(config, plan_for(args, config), use_te=use_te, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False), parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000), rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0), vp_stage=vp_stage, pg_collection=pg_collection)


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's gpt_builders.gpt_builder signature: pretrain_gpt's partial(model_provider, gpt_builder)."""
    if config is None:
        config = _config_from_args(args)
    return build_gpt_model(args, config, pre_process, post_process, vp_stage, pg_collection)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """The model_provider pretrain() calls, reading Megatron-LM's global arguments."""
    from megatron.training import get_args

    return gpt_builder(get_args(), pre_process, post_process, vp_stage, config, pg_collection)


def _config_from_args(args):
    """The TransformerConfig Megatron-LM makes from its arguments."""
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)
