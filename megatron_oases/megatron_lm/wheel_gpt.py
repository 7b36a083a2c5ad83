"""What Megatron-LM's ``pretrain_gpt.py`` hands to ``pretrain``, for runs without a checkout.

From 0.17 the megatron-core wheel ships ``megatron.training`` (the loop, its args, checkpointing)
but not Megatron-LM's top-level ``pretrain_gpt.py``, ``gpt_builders.py`` and
``model_provider.py``. Without ``MEGATRON_LM_PATH`` our entry takes the script's four pieces from
here instead, each built from Megatron's own parts:

* ``forward_step``: the batch from ``megatron.training.utils`` / ``megatron.core.utils``'
  ``get_batch_on_this_tp_rank`` (``mcore_compat.batch_on_this_tp_rank``), the model's per-token
  losses, and the loss function of ``pretrain_gpt.py`` (masked sum, token count, the ``lm loss``
  report, the rerun state machine's NaN / Inf / spiky-loss checks);
* ``train_valid_test_datasets_provider``: ``BlendedMegatronDatasetBuilder`` over
  ``MockGPTDataset`` (``--mock-data``) or ``GPTDataset`` (``--data-path`` and friends), with the
  ``GPTDatasetConfig`` Megatron-LM builds from the same flags;
* ``get_embedding_ranks``: the first pipeline stage, and the last with tied embeddings;
* the model: none of Megatron-LM's own (``model_provider = None``), so ``ModelProvider`` builds
  every run, stock ones too, with ``megatron_oases.specs`` (the ``megatron`` spec for a stock
  run, Megatron-Core's local layers). Flags that only the script's other paths read (SFT, FIM,
  packed sequences, distillation) are refused (``refusal``): they would do nothing here.

The module has the attribute names of the checkout's ``pretrain_gpt.py``, so the entry treats
both alike.
"""
from __future__ import annotations

from functools import partial

model_provider = None
"""No Megatron-LM model provider: ``ModelProvider(None)`` builds every run."""
gpt_builder = None
has_nvidia_modelopt = False

SPIKY_LOSS_FACTOR = 10
"""``pretrain_gpt.py``'s spiky loss: 10x the largest loss seen so far."""

UNSUPPORTED = (
    ("sft", "--sft", "packed SFT sequences"),
    ("fim_data", "--fim-data", "fill-in-the-middle data"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking",
     "packed sequences"),
    ("logits_load_dir", "--logits-load-dir", "distillation from cached logits"),
)
"""(dest, flag, what) of ``pretrain_gpt.py`` features this module does not implement."""


def refusal(args) -> str | None:
    """The one-line reason this run needs a Megatron-LM checkout, or None."""
    from megatron_oases.run_config import options_present

    present = options_present(args, [dest for dest, _, _ in UNSUPPORTED])
    for dest, flag, what in UNSUPPORTED:
        if present.get(dest):
            return (f"{flag} ({what}) needs Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_PATH "
                    f"to a checkout of the installed release, or drop {flag}")
    return None


def _get_args():
    from megatron.training import get_args

    return get_args()


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of this rank's micro-batch;
    all None on a middle pipeline stage (it receives activations, not data)."""
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from megatron_oases.mcore_compat import batch_on_this_tp_rank

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = batch_on_this_tp_rank(data_iterator, _get_args())
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask, output_tensor, model=None):
    """``pretrain_gpt.py``'s loss: (masked loss sum, token count, {'lm loss': [sum, count]})."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    args = _get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        rerun.validate_result(
            result=loss, message="Spiky loss", tolerance=0.0, fatal=False,
            rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"))
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward step: one micro-batch through ``model``, and the loss function."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def dataset_config(args):
    """Megatron-LM's ``GPTDatasetConfig`` for these args (``core_gpt_dataset_config_from_args``
    without its FIM branch, which ``refusal`` refuses)."""
    import json

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel)


def _built_on_this_rank(vp_stage=None) -> bool:
    """Datasets are read on TP rank 0 of the first and last pipeline stages (then broadcast)."""
    from megatron.core import mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """The train, validation and test datasets (Megatron-Core's GPT datasets)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import print_rank_0

    args = _get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        partial(_built_on_this_rank, vp_stage=vp_stage), dataset_config(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # each rank calls it (Megatron-LM's flag)


def get_embedding_ranks(pp_ranks):
    """Ranks holding word embeddings: the first stage, and the last one when the output layer
    shares them (``pretrain_gpt.py``'s rule without multi-token prediction, which is refused)."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not _get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))
