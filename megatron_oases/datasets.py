"""Megatron-LM's data flags for the reference trainer, on Megatron-Core's own dataset code.

``--mock-data`` builds Megatron-Core's ``MockGPTDataset`` and ``--data-path`` its ``GPTDataset``
over ``IndexedDataset`` .bin/.idx files, both through ``BlendedMegatronDatasetBuilder`` with a
``GPTDatasetConfig``, as Megatron-LM's ``pretrain_gpt.py`` does. Nothing of that code is copied
here; this module only turns flags into a config and datasets into micro-batches.

Why not Megatron's DataLoader and samplers: every parallel layout (TP/PP/DP, backend, schedule)
must see the same global batch so that runs can be compared loss for loss. Sample ``i`` of
iteration ``t`` is therefore always dataset index ``(t - 1) * global_batch + i``, and a global
batch is split over data-parallel ranks exactly as the synthetic data splits it
(``data.micro_batch_indices``). Megatron's pretraining sampler visits the same indices in the same
order; only the assignment of samples to micro-batches differs.

Tokenizer-free: ``GPTDatasetConfig`` needs a tokenizer only for its end-of-document id (mock data
ends each document with it, and the pad-token check compares against it). ``TokenIdTokenizer`` is
Megatron-Core's ``NullTokenizer`` (what Megatron-LM's ``--tokenizer-type NullTokenizer`` builds),
sized so that ``--vocab-size V`` stays the model's vocabulary before padding: ids ``0..V-1`` with
the end-of-document id ``V - 1`` by default (``--eod-token-id`` overrides it). Megatron-LM's
``NullTokenizer --vocab-size N`` has ``N + 1`` ids with eod ``N``: the same data runs here with
``--vocab-size N+1``.

With the synthetic default data, validation draws from a disjoint synthetic stream: validation
batch ``b`` (counted over the whole run) uses the synthetic generator at iteration ``-(b + 1)``,
which training (iterations ``1..T``) never visits.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from megatron_oases.errors import ConfigError
from megatron_oases.run_config import DEFAULTS, RunConfig

DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's default when --data-path is given and --split is not
DEFAULT_EVAL_ITERS = 10  # Megatron-LM's default is 100; 10 keeps CPU runs short


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The ``data`` and ``validation`` flag groups (Megatron-LM's names and meanings)."""
    g = parser.add_argument_group(
        "data", "default: synthetic data (megatron_oases.data); these flags switch to "
                 "Megatron-Core's GPT datasets (see docs/data.md)")
    g.add_argument("--mock-data", action="store_true",
                   help="Megatron-Core's MockGPTDataset (as Megatron-LM's --mock-data)")
    g.add_argument("--data-path", nargs="+", default=DEFAULTS.data_path, metavar="PREFIX",
                   help="indexed GPT dataset(s): PREFIX.bin/PREFIX.idx from Megatron's "
                        "preprocess_data.py or IndexedDatasetBuilder; several prefixes, or "
                        "'W1 P1 W2 P2 ...' for a weighted blend")
    g.add_argument("--split", default=DEFAULTS.split,
                   help=f"train,valid,test weights over the documents of --data-path "
                        f"(default {DEFAULT_SPLIT}, as Megatron-LM)")
    g.add_argument("--data-cache-path", default=DEFAULTS.data_cache_path,
                   help="where Megatron writes its dataset index cache (default: next to the "
                        "data, PREFIX/cache/GPTDataset_indices)")
    g.add_argument("--eod-token-id", type=int, default=DEFAULTS.eod_token_id,
                   help="end-of-document token id of the data (default --vocab-size - 1, i.e. "
                        "Megatron's NullTokenizer with --vocab-size - 1 ids)")
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=DEFAULTS.eval_interval,
                   help="every N iterations (and after the last) run --eval-iters forward-only "
                        "batches of the validation split and print Megatron's validation line")
    g.add_argument("--eval-iters", type=int, default=DEFAULTS.eval_iters,
                   help=f"global batches per validation (default {DEFAULT_EVAL_ITERS} with "
                        "--eval-interval; 0 disables validation, as in Megatron-LM)")


def uses_megatron_data(cfg: RunConfig) -> bool:
    return bool(cfg.mock_data or cfg.data_path)


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as Megatron's (prefixes, weights or None), parsed by Megatron-Core's
    ``get_blend_from_list``. A list that is neither all prefixes nor all weight-prefix pairs is
    refused here: Megatron-Core would read it as prefixes named like numbers."""
    from megatron.core.datasets.utils import get_blend_from_list

    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    numbers = sum(is_number(v) for v in data_path[0::2]) if len(data_path) % 2 == 0 else 0
    if 0 < numbers < len(data_path) // 2:
        raise ConfigError(f"--data-path must be PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ... "
                          f"(got {' '.join(data_path)})")
    prefixes, weights = get_blend_from_list(list(data_path))
    if weights is not None and any(w <= 0 for w in weights):
        raise ConfigError(f"--data-path weights must be > 0 (got {' '.join(data_path)})")
    return prefixes, weights


def parse_split(split: str) -> list[float]:
    """``--split`` as three non-negative weights (fewer are padded with 0, as Megatron does)."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split must be up to three non-negative train,valid,test weights "
                          f"with a positive sum, e.g. {DEFAULT_SPLIT} (got {split!r})")
    return values + [0.0] * (3 - len(values))


def validate_data_config(cfg: RunConfig) -> RunConfig:
    """Data and validation flags; runs before any process group (one-line ConfigError).
    Returns ``cfg`` with ``eval_iters`` filled in under ``--eval-interval``."""
    if cfg.mock_data and cfg.data_path:
        raise ConfigError("--mock-data and --data-path are exclusive: mock data replaces the "
                          "files; drop one")
    megatron_data = uses_megatron_data(cfg)
    for flag, value in (("--split", cfg.split), ("--data-cache-path", cfg.data_cache_path),
                        ("--eod-token-id", cfg.eod_token_id)):
        if value is not None and not megatron_data:
            raise ConfigError(f"{flag} needs --data-path (or --mock-data); the default synthetic "
                              "data has no files, splits or end-of-document token")
    if cfg.split is not None and cfg.mock_data:
        raise ConfigError("--split needs --data-path: --mock-data draws its own even 1,1,1 split "
                          "(as in Megatron-Core); drop --split")
    if cfg.eval_interval is not None and cfg.eval_interval < 1:
        raise ConfigError(f"--eval-interval must be >= 1 (got {cfg.eval_interval})")
    if cfg.eval_iters is not None and cfg.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0 (got {cfg.eval_iters}); 0 disables "
                          "validation")
    if cfg.eval_iters and cfg.eval_interval is None:
        raise ConfigError(f"--eval-iters {cfg.eval_iters} needs --eval-interval N (how often to "
                          "validate)")
    if cfg.eval_interval is not None and cfg.eval_iters is None:
        cfg = dataclasses.replace(cfg, eval_iters=DEFAULT_EVAL_ITERS)
    if cfg.eod_token_id is not None and not 0 <= cfg.eod_token_id < cfg.vocab_size:
        raise ConfigError(f"--eod-token-id {cfg.eod_token_id} must be a token id in "
                          f"[0, --vocab-size {cfg.vocab_size})")
    if not megatron_data:
        return cfg
    _check_helpers()
    if cfg.data_path:
        prefixes, _ = parse_blend(cfg.data_path)
        for prefix in prefixes:
            _check_prefix(prefix, cfg.vocab_size)
        split = parse_split(cfg.split if cfg.split is not None else DEFAULT_SPLIT)
        if split[0] == 0:
            raise ConfigError(f"--split {cfg.split} gives the training split no documents; "
                              "give its first weight > 0")
        if eval_enabled(cfg) and split[1] == 0:
            raise ConfigError(f"--eval-interval needs a validation split but --split "
                              f"{cfg.split} gives it weight 0; e.g. --split {DEFAULT_SPLIT}")
        for prefix in prefixes:
            _check_split_documents(prefix, split, cfg.split or DEFAULT_SPLIT,
                                   used=(True, eval_enabled(cfg), False))
    return cfg


def check_split_documents(data_path: list[str], split_flag: str | None) -> None:
    """Megatron-LM's loop (``python -m megatron_oases.pretrain_gpt``, the patched checkout) builds
    every split of nonzero weight, the test split even with ``--eval-iters 0``: each must have
    documents in every ``--data-path`` prefix (``_check_split_documents``), one line if not."""
    prefixes, _ = parse_blend(data_path)
    split = parse_split(split_flag if split_flag is not None else DEFAULT_SPLIT)
    for prefix in prefixes:
        _check_files(prefix)
        _check_split_documents(prefix, split, split_flag or DEFAULT_SPLIT,
                               used=tuple(w > 0 for w in split))


def _check_helpers() -> None:
    """GPTDataset builds its sample index with Megatron-Core's compiled helpers (pybind11).

    The megatron-core wheels ship them prebuilt (``helpers_cpp*.so``); an install built from
    source without a compiler has none, and GPTDataset would fail only after every rank started.
    """
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--data-path/--mock-data need Megatron-Core's compiled dataset helpers "
                          f"(megatron.core.datasets.helpers_cpp: {exc}); reinstall megatron-core "
                          "from a binary wheel, or from source with g++ and pybind11 present") \
            from None


SCAN_BYTES = 32 * 2**20
"""Token-id scan before start-up (``_check_token_ids``): a .bin up to this size is read whole; a
larger one in ``SCAN_WINDOWS`` windows spread evenly over it that add up to this size."""
SCAN_WINDOWS = 32


def _check_prefix(prefix: str, vocab_size: int) -> None:
    """Both files exist, the .idx is a Megatron index whose size matches its header, the .bin
    holds every byte the .idx points to, and the token ids a bounded scan reads are < vocab."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    _check_files(prefix)
    with open(prefix + ".idx", "rb") as f:
        header = f.read(len(_INDEX_HEADER))
    if header != _INDEX_HEADER:
        raise ConfigError(f"--data-path {prefix}: {prefix}.idx is not a Megatron index file "
                          "(bad header); rebuild it with preprocess_data.py or IndexedDatasetBuilder")
    dtype, tokens = _check_index_sizes(prefix)
    _check_token_ids(prefix, dtype, tokens, vocab_size)


def _check_files(prefix: str) -> None:
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise ConfigError(f"--data-path {prefix}: {' and '.join(missing)} not found; pass the "
                          "prefix of a .bin/.idx pair (without the extension)")


def _check_index_sizes(prefix: str):
    """Read the .idx as Megatron's ``_IndexReader`` does (version 1, a token type code, sequence
    and document counts, then int32 lengths, int64 byte pointers and int64 document indices) and
    compare the file sizes with it: an .idx cut short, or a .bin shorter than the bytes its last
    sequence ends at (a copy cut short), would otherwise fail on every rank after start-up, once
    Megatron has written its index cache. Returns (token dtype, tokens the .bin holds)."""
    import struct

    import numpy
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    rebuild = "rebuild the pair (preprocess_data.py / IndexedDatasetBuilder) or copy it again"
    fixed = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, two counts
    idx_bytes = os.path.getsize(idx)
    with open(idx, "rb") as f:
        f.seek(len(_INDEX_HEADER))
        head = f.read(fixed - len(_INDEX_HEADER))
        if len(head) < fixed - len(_INDEX_HEADER):
            raise ConfigError(f"--data-path {prefix}: {idx} is {idx_bytes} bytes, shorter than "
                              f"Megatron's {fixed}-byte index header (truncated); {rebuild}")
        version, code, sequences, documents = struct.unpack("<QBQQ", head)
        if version != 1:
            raise ConfigError(f"--data-path {prefix}: {idx} has index version {version}, Megatron "
                              f"reads version 1; {rebuild}")
        try:
            dtype = DType.dtype_from_code(code)
        except (KeyError, ValueError):
            raise ConfigError(f"--data-path {prefix}: {idx} names token type code {code}, which "
                              f"Megatron does not know; {rebuild}") from None
        want = fixed + sequences * (4 + 8) + documents * 8
        if idx_bytes != want:
            raise ConfigError(f"--data-path {prefix}: {idx} is {idx_bytes} bytes but its header "
                              f"({sequences} sequences, {documents} documents) needs {want} "
                              f"(truncated or damaged); {rebuild}")
        if sequences == 0:
            return dtype, 0
        f.seek(fixed + (sequences - 1) * 4)
        last_length = int(numpy.frombuffer(f.read(4), dtype=numpy.int32)[0])
        f.seek(fixed + sequences * 4 + (sequences - 1) * 8)
        last_pointer = int(numpy.frombuffer(f.read(8), dtype=numpy.int64)[0])
    size = numpy.dtype(dtype).itemsize
    end = last_pointer + last_length * size
    bin_bytes = os.path.getsize(bin_)
    if bin_bytes < end:
        raise ConfigError(f"--data-path {prefix}: {bin_} is {bin_bytes} bytes but {idx} indexes "
                          f"{end} ({sequences} sequences of {numpy.dtype(dtype).name} tokens): "
                          f"the .bin is truncated or belongs to another index; {rebuild}")
    return dtype, end // size


def _check_token_ids(prefix: str, dtype, tokens: int, vocab_size: int) -> None:
    """Token ids in [0, --vocab-size), by a bounded scan before start-up: a .bin of up to
    ``SCAN_BYTES`` whole, a larger one in ``SCAN_WINDOWS`` evenly spread windows (one second or
    so even on a network file system, whatever the corpus size). A tokenizer that does not match
    ``--vocab-size`` puts large ids everywhere, so the windows find it; an id they miss still
    stops the run when a batch holds it (``MegatronData._batches``, naming --vocab-size)."""
    import numpy

    dtype = numpy.dtype(dtype)
    if dtype.kind == "u" and numpy.iinfo(dtype).max < vocab_size:
        return  # no id of this type can reach the vocabulary size
    per_window = max(SCAN_BYTES // SCAN_WINDOWS // dtype.itemsize, 1)
    if tokens * dtype.itemsize <= SCAN_BYTES:
        starts, count = [0], tokens
    else:
        step = (tokens - per_window) / (SCAN_WINDOWS - 1)
        starts, count = [int(i * step) for i in range(SCAN_WINDOWS)], per_window
    for start in starts:
        ids = numpy.fromfile(prefix + ".bin", dtype=dtype, count=count,
                             offset=start * dtype.itemsize)
        bad = numpy.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            at = int(bad[0])
            raise ConfigError(f"--data-path {prefix}: {prefix}.bin holds token id {ids[at]} "
                              f"(token {start + at}) outside [0, --vocab-size {vocab_size}); pass "
                              "the vocabulary size of the data's tokenizer as --vocab-size")


def _check_split_documents(prefix: str, split: list[float], split_flag: str, *,
                           used: tuple[bool, bool, bool]) -> None:
    """Every split that is built (``used``: train, validation, test) has documents.
    Megatron-Core rounds ``weight x documents`` per split, and a split left with none never
    finishes counting its epochs (GPTDataset._get_num_epochs loops forever on 0 tokens, even for
    0 samples), so a small file would hang the run."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    total = sum(split)
    matrix = convert_split_vector_to_split_matrix([w / total for w in split])
    n = IndexedDataset(prefix, multimodal=False, mmap=True).sequence_lengths.shape[0]
    for i, name in enumerate(("train", "validation", "test")):
        if not used[i]:
            continue
        docs = 0 if matrix[i] is None else (int(round(matrix[i][1] * n))
                                            - int(round(matrix[i][0] * n)))
        if docs == 0:
            zero = ", or weight 0 to build none" if name == "test" else ""
            raise ConfigError(f"--split {split_flag} leaves the {name} split of --data-path "
                              f"{prefix} no documents (it has {n}); give that split more "
                              f"weight{zero}, or use more documents")


def eval_enabled(cfg: RunConfig) -> bool:
    return bool(cfg.eval_interval and cfg.eval_iters)


def num_evaluations(cfg: RunConfig) -> int:
    """Validations in a run: one per ``--eval-interval`` and one after the last iteration."""
    return validations_through(cfg, cfg.train_iters)


def validations_through(cfg, iteration: int) -> int:
    """Validations a run of ``cfg`` has made once ``iteration`` ended (``evaluate.Validator``'s
    rule). ``cfg``: a ``RunConfig``, or the flags a checkpoint saved (``eval_interval``,
    ``eval_iters``, ``train_iters``), for checkpoints older than ``consumed_valid_samples``."""
    if not eval_enabled(cfg):
        return 0
    return iteration // cfg.eval_interval + (iteration >= cfg.train_iters)


def token_id_tokenizer(vocab_size: int, eod: int | None = None):
    """Megatron-Core's NullTokenizer with ``vocab_size`` ids and end-of-document ``eod``
    (default ``vocab_size - 1``, NullTokenizer's own choice for that size)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    class TokenIdTokenizer(NullTokenizer):
        """NullTokenizer whose eod may be any id; its identifiers name vocabulary and eod, since
        Megatron hashes them into the dataset cache key."""

        def __init__(self, vocab_size: int, eod: int):
            super().__init__(vocab_size - 1)  # NullTokenizer(n): n ids plus eod n
            self._eod_id = eod

        @property
        def unique_identifiers(self):
            ids = super().unique_identifiers
            ids.update(vocab_size=self.vocab_size, eod=self.eod)
            return ids

    return TokenIdTokenizer(vocab_size, vocab_size - 1 if eod is None else eod)


def dataset_config(cfg: RunConfig):
    """The GPTDatasetConfig Megatron-LM's pretrain_gpt builds for these flags (no reset of
    position ids / attention mask, no EOD loss masking: Megatron-LM's defaults). Attention masks
    are not built: the model applies its causal mask itself, as with
    ``--no-create-attention-mask-in-dataloader``."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = parse_blend(cfg.data_path) if cfg.data_path else None
    return GPTDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.seq_length, blend=blend,
        split=(cfg.split or DEFAULT_SPLIT) if blend else None,
        path_to_cache=cfg.data_cache_path,
        tokenizer=token_id_tokenizer(cfg.vocab_size, cfg.eod_token_id),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mid_level_dataset_surplus=0.005)


def build_datasets(cfg: RunConfig, global_batch_size: int):
    """(train, valid, test) datasets with Megatron-LM's sample counts: train_iters x global batch
    for training, (train_iters // eval_interval + 1) x eval_iters x global batch for validation,
    eval_iters x global batch for test. Collective when a process group exists (rank 0 builds and
    caches the indices first, the others then read them): call on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    eval_iters = cfg.eval_iters if eval_enabled(cfg) else 0
    sizes = [cfg.train_iters * global_batch_size,
             num_evaluations(cfg) * eval_iters * global_batch_size,
             eval_iters * global_batch_size]
    config = dataset_config(cfg)
    # Splits this trainer never reads (test; validation without --eval-interval) are not built:
    # their entry of the split matrix becomes None, the others keep Megatron's document
    # boundaries. Megatron-LM would build them, and a split that rounds to no documents (the
    # 0.1% test share of a small file) would stall it (see _check_split_documents).
    used = (True, eval_enabled(cfg), False)
    config.split_matrix = [m if u else None for m, u in zip(config.split_matrix, used)]
    cls = MockGPTDataset if cfg.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


class SyntheticData:
    """The default data (``megatron_oases.data``) behind the same interface as MegatronData."""

    def __init__(self, cfg: RunConfig, dp_rank: int, dp_size: int, device):
        self.cfg, self.dp_rank, self.dp_size, self.device = cfg, dp_rank, dp_size, device

    def _batches(self, iteration: int) -> list[dict]:
        from megatron_oases.data import micro_batches

        a = self.cfg
        return micro_batches(seed=a.seed, iteration=iteration, global_batch_size=a.global_batch_size,
                             micro_batch_size=a.micro_batch_size, dp_rank=self.dp_rank,
                             dp_size=self.dp_size, seq_length=a.seq_length,
                             vocab_size=a.vocab_size, device=self.device)

    def train_batches(self, iteration: int) -> list[dict]:
        """This rank's micro-batches of training iteration ``iteration`` (1-based)."""
        return self._batches(iteration)

    def valid_batches(self, number: int) -> list[dict]:
        """This rank's micro-batches of validation batch ``number`` (0-based, over the run)."""
        return self._batches(-(number + 1))


class MegatronData:
    """Micro-batches drawn from Megatron-Core datasets by global sample number."""

    def __init__(self, cfg: RunConfig, dp_rank: int, dp_size: int, device):
        self.cfg, self.dp_rank, self.dp_size, self.device = cfg, dp_rank, dp_size, device
        self.train, self.valid, _ = build_datasets(cfg, cfg.global_batch_size)
        need = [("train", self.train, cfg.train_iters * cfg.global_batch_size)]
        if eval_enabled(cfg):
            need.append(("validation", self.valid,
                         num_evaluations(cfg) * cfg.eval_iters * cfg.global_batch_size))
        for name, dataset, samples in need:
            # An unweighted multi-prefix blend is one epoch of its datasets (Megatron-Core's
            # rule), which may hold fewer samples than the run reads.
            if dataset is None or len(dataset) < samples:
                raise ValueError(
                    f"--data-path: the {name} split holds {0 if dataset is None else len(dataset)}"
                    f" samples of --seq-length {cfg.seq_length} but the run reads {samples}; "
                    "give weights (W1 P1 W2 P2 ...) to sample several epochs, or more data")

    def _batches(self, dataset, first: int, what: str) -> list[dict]:
        import torch

        from megatron_oases.data import micro_batch_indices

        a = self.cfg
        out = []
        for idx in micro_batch_indices(global_batch_size=a.global_batch_size,
                                       micro_batch_size=a.micro_batch_size,
                                       dp_rank=self.dp_rank, dp_size=self.dp_size):
            samples = [dataset[first + i] for i in idx]
            batch = {key: torch.stack([s[key] for s in samples])
                     for key in ("tokens", "labels", "loss_mask", "position_ids")}
            # checked on the host, before the move (on a GPU the check would synchronise)
            top = int(max(batch["tokens"].max(), batch["labels"].max()))
            if top >= a.vocab_size:
                raise ValueError(f"{what} sample holds token id {top} >= --vocab-size "
                                 f"{a.vocab_size}; pass the vocabulary size of the data's "
                                 "tokenizer")
            out.append({key: t.to(self.device) for key, t in batch.items()})
        return out

    def train_batches(self, iteration: int) -> list[dict]:
        """Samples ``(iteration - 1) * global_batch + i`` of the train split, this rank's share."""
        return self._batches(self.train, (iteration - 1) * self.cfg.global_batch_size, "train")

    def valid_batches(self, number: int) -> list[dict]:
        """Samples ``number * global_batch + i`` of the validation split, this rank's share."""
        return self._batches(self.valid, number * self.cfg.global_batch_size, "validation")


def build_data(cfg: RunConfig, dp_rank: int, dp_size: int, device):
    """The run's data source: Megatron-Core datasets with --mock-data/--data-path, else synthetic.
    Call on every rank after the process groups exist."""
    cls = MegatronData if uses_megatron_data(cfg) else SyntheticData
    return cls(cfg, dp_rank, dp_size, device)
