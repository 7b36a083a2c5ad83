"""Plan files (``--oases-plan plan.json``), the paper's compact notation, and launch rewriting.

The file format is documented in docs/planner.md. ``load_plan`` is what a launcher or the
per-block runtime calls: every problem is one ``ConfigError`` line naming ``--oases-plan``.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from megatron_oases.describe.split import sub_batches_at
from megatron_oases.errors import ConfigError

from megatron_oases.describe.backends import backend
from megatron_oases.describe.layout import Layout
from megatron_oases.describe.ops import ModelingError

from .graph import BLOCK_KINDS, BlockStrategy, family_layouts, family_of, strategy_of_label
from megatron_oases.flags import option

PLAN_FORMAT = "megatron-oases-plan/1"
FLAG = option("oases_plan")
TP_FLAG = option("tensor_model_parallel_size")
PP_FLAG = option("pipeline_model_parallel_size")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated plan: one TP degree per block (layer 0 attention, layer 0 mlp, layer 1 ...)."""

    tp: int
    num_layers: int
    degrees: tuple[int, ...]
    block_kinds: tuple[str, ...] = BLOCK_KINDS
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def layer_degrees(self, layer: int) -> dict[str, int]:
        """``{"attention": d, "mlp": d}`` of one TransformerLayer."""
        k = len(self.block_kinds)
        return dict(zip(self.block_kinds, self.degrees[layer * k:(layer + 1) * k]))

    @property
    def per_layer(self) -> tuple[int, ...] | None:
        """One degree per layer when each layer's blocks agree (Table 6's form), else None."""
        k = len(self.block_kinds)
        layers = [self.degrees[i:i + k] for i in range(0, len(self.degrees), k)]
        if all(len(set(x)) == 1 for x in layers):
            return tuple(x[0] for x in layers)
        return None


def compact_notation(degrees) -> str:
    """Run-length form of the paper's Table 6: ``[[2] * 8 + [4] * 16]``."""
    runs: list[list[int]] = []
    for d in degrees:
        if runs and runs[-1][0] == d:
            runs[-1][1] += 1
        else:
            runs.append([int(d), 1])
    return "[" + " + ".join(f"[{d}] * {n}" for d, n in runs) + "]"


def parse_compact(text: str) -> tuple[int, ...]:
    """Inverse of ``compact_notation`` (also accepts a plain list ``[2, 2, 4]``)."""
    body = text.strip()
    if body.startswith("[[") and body.endswith("]"):
        body = body[1:-1]
    out: list[int] = []
    for part in body.split("+"):
        mt = re.fullmatch(r"\s*\[(\d+)\]\s*\*\s*(\d+)\s*", part)
        if mt:
            out += [int(mt.group(1))] * int(mt.group(2))
            continue
        mt = re.fullmatch(r"\s*\[([\d,\s]*)\]\s*", part)
        if not mt:
            raise ValueError(f"cannot parse {part.strip()!r} of {text!r} (expected [d] * n)")
        out += [int(x) for x in mt.group(1).replace(",", " ").split()]
    return tuple(out)


_NUMBER_LIST = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*)\s*\]")


def write_plan(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """JSON with one key per line, but lists of numbers (``degrees``) on one line."""
    text = _NUMBER_LIST.sub(lambda mt: "[" + ", ".join(x.strip() for x in mt.group(1).split(",")) + "]",
                            json.dumps(data, indent=1))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _fail(path: str, problem: str) -> None:
    raise ConfigError(f"{FLAG} {path}: {problem}")


def load_plan(path: str | os.PathLike, *, num_layers: int, tp: int) -> Plan:
    """Read and check a plan file against the launch (``--num-layers``, TP size)."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        _fail(p, f"cannot be read ({e.strerror or e}); give the JSON written by `megatron-oases plan`")
    except ValueError as e:
        _fail(p, f"is not valid JSON ({e}); regenerate it with `megatron-oases plan`")
    if not isinstance(data, dict):
        _fail(p, f"must be a JSON object (got {type(data).__name__})")
    if data.get("format") != PLAN_FORMAT:
        _fail(p, f"format is {data.get('format')!r}, expected {PLAN_FORMAT!r}; "
                 "regenerate it with `megatron-oases plan`")
    try:
        backend = whole_model_backend(data)
    except ConfigError as e:
        _fail(p, str(e))
    if backend is not None:
        how = " ".join(f"{k} {v}" for k, v in backend.items())
        _fail(p, f"runs the whole model as --tp-backend {backend[option('tp_backend')]}, which is a backend, "
                 f"not a per-block plan: launch with {how} instead of {FLAG}")
    ftp, flayers, kinds, degrees = (data.get("tensor_model_parallel_size"), data.get("num_layers"),
                                    data.get("block_kinds", list(BLOCK_KINDS)), data.get("degrees"))
    if ftp != tp:
        _fail(p, f"was made for {TP_FLAG} {ftp!r} but the launch uses {tp}; plan again for TP {tp} "
                 f"or launch with {TP_FLAG} {ftp}")
    if flayers != num_layers:
        _fail(p, f"was made for --num-layers {flayers!r} but the launch uses {num_layers}; plan again")
    if kinds != list(BLOCK_KINDS):
        _fail(p, f"block_kinds {kinds!r} are not {list(BLOCK_KINDS)}")
    if not isinstance(degrees, list) or any(isinstance(d, bool) or not isinstance(d, int) for d in degrees):
        _fail(p, "'degrees' must be a list of integers (one TP degree per block)")
    want = num_layers * len(BLOCK_KINDS)
    if len(degrees) != want:
        _fail(p, f"has {len(degrees)} block degrees; {num_layers} layers need {want} "
                 f"({len(BLOCK_KINDS)} blocks per layer: {', '.join(BLOCK_KINDS)})")
    bad = [(i, d) for i, d in enumerate(degrees) if d < 1 or tp % d or d & (d - 1)]
    if bad:
        i, d = bad[0]
        _fail(p, f"block {i} (layer {i // len(BLOCK_KINDS)} {BLOCK_KINDS[i % len(BLOCK_KINDS)]}) has degree {d}, "
                 f"which is not a power of two dividing {TP_FLAG} {tp}"
                 + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))
    return Plan(tp=tp, num_layers=num_layers, degrees=tuple(degrees), raw=data)


def validate_plan_args(cfg, dims) -> tuple[tuple[int, int], ...] | None:
    """Check ``--oases-plan`` against the launch before any process group exists; returns the
    run's ``oases_layer_degrees``: per layer, the (attention, mlp) TP degrees (None without a
    plan). ``cfg``: the run's ``run_config.RunConfig``."""
    path = cfg.oases_plan
    if path is None:
        return None
    plan = load_plan(path, num_layers=cfg.num_layers, tp=dims.tp)
    check_plan_launch(path, plan.raw, cfg, dims, warn=cfg.oases_layer_degrees is None)
    layers = tuple((plan.layer_degrees(i)["attention"], plan.layer_degrees(i)["mlp"])
                   for i in range(plan.num_layers))
    oases = cfg.schedule == "oases"
    if not backend(cfg.tp_backend).per_block_plans:
        raise ConfigError(f"{FLAG} runs Megatron 1-D TP sub-groups and cannot be combined with "
                          f"--tp-backend {cfg.tp_backend}; use --tp-backend megatron")
    if cfg.sequence_parallel:
        raise ConfigError(f"{FLAG} splits the batch across replicas and cannot be combined with "
                          f"--sequence-parallel; drop one of them")
    # Degree t: T/t replicas, each splitting its slice into the Oases split's sub-batches unless
    # t = 1 (describe.split.sub_batches_at). All powers of two, so the largest need covers the others.
    degrees = {d for pair in layers for d in pair}
    need, degree = max(((dims.tp // t) * sub_batches_at(t, oases=oases), -t) for t in degrees)
    degree = -degree
    if cfg.micro_batch_size % need:
        _fail(path, f"its degree-{degree} blocks split each micro-batch over {dims.tp // degree} "
                    f"replicas" + (f" and then into {need // (dims.tp // degree)} Oases sub-batches"
                                   if need > dims.tp // degree else "")
                    + f": --micro-batch-size must be a multiple of {need} "
                      f"(got {cfg.micro_batch_size})")
    return layers


LAUNCH_FIELDS = ("world_size", "data_parallel_size", "micro_batch_size", "schedule")
"""What a plan file records of the launch it is made for (``megatron-oases plan``)."""


def check_plan_launch(path: str, data: dict[str, Any], cfg, dims, *, warn: bool = True) -> None:
    """Refuse a plan made for another launch (pipeline stages, data-parallel size, micro-batch, ``--schedule``), one
    line naming the flag. A file written before plans recorded their launch is loaded unchecked,
    with one warning line on rank 0 (``warn``: the first validation of the run), on stdout like the
    run's other notes, so that a refusal is still the one line on stderr: refusing the file would
    stop launches that ran. ``cfg``: the run's ``RunConfig``; ``dims``: its ``ParallelDims``."""
    made = {k: data.get(k) for k in LAUNCH_FIELDS}
    if any(v is None for v in made.values()):
        if warn and os.environ.get("RANK", "0") == "0":
            print(f"warning: {FLAG} {path} does not record the launch it was made for (world, micro-batch, "
                  f"--schedule), so it is not checked against this one; plan again to have it checked",
                  flush=True)
        return
    # a file without it was made before plan took the flag: for one stage
    made_pp = data.get("pipeline_model_parallel_size", 1)
    if made_pp != dims.pp:
        _fail(path, f"was made for {PP_FLAG} {made_pp} but this launch runs {PP_FLAG} {dims.pp}; plan again "
                    f"with {PP_FLAG} {dims.pp} or launch with {PP_FLAG} {made_pp}")
    if made["data_parallel_size"] != dims.dp:
        _fail(path, f"was made for data-parallel size {made['data_parallel_size']} (world {made['world_size']}) "
                    f"but this launch's is {dims.dp} (world {dims.world_size} / TP {dims.tp} / PP {dims.pp}); "
                    f"plan again with --data-parallel-size {dims.dp}")
    if made["micro_batch_size"] != cfg.micro_batch_size:
        _fail(path, f"was made for --micro-batch-size {made['micro_batch_size']} but the launch uses "
                    f"{cfg.micro_batch_size}; plan again or launch with --micro-batch-size {made['micro_batch_size']}")
    if made["schedule"] != cfg.schedule:
        _fail(path, f"was made for --schedule {made['schedule']} but the launch uses --schedule {cfg.schedule}; "
                    f"plan again with --schedule {cfg.schedule} or launch with --schedule {made['schedule']}")


# ---- launch command rewriting ------------------------------------------------------------------

_TOKEN = re.compile(r"""(?:[^\s'"\\]|\\.|'[^']*'|"(?:[^"\\]|\\.)*")+""", re.S)


def _tokens(cmd: str) -> list[tuple[int, int, str]]:
    """(start, end, unquoted text) of every shell word, so edits keep the rest byte for byte."""
    out = []
    for mt in _TOKEN.finditer(cmd):
        raw = mt.group(0)
        if raw == "\\\n":
            continue
        try:
            words = shlex.split(raw)
        except ValueError:
            words = [raw]
        out.append((mt.start(), mt.end(), words[0] if words else ""))
    return out


def plan_record(strategies, assignment, *, num_layers: int, world_size: int, data_parallel_size: int,
                pipeline_model_parallel_size: int, micro_batch_size: int, schedule: str, tp: int) -> dict[str, Any]:
    """The fields every plan file holds, one writer for ``plan`` and ``sim --search``'s plan step:
    the solver's ``assignment`` (indices into ``strategies``, one per block of a stage) repeated
    over the pipeline's stages as ``degrees``, and the launch it is made for, which
    ``check_plan_launch`` compares (``LAUNCH_FIELDS``)."""
    degrees = [strategies[k].degree for k in assignment] * pipeline_model_parallel_size  # every stage alike
    return {
        "format": PLAN_FORMAT,
        "tensor_model_parallel_size": tp,
        "num_layers": num_layers,
        "world_size": world_size, "data_parallel_size": data_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "micro_batch_size": micro_batch_size,
        "schedule": schedule,
        "block_kinds": list(BLOCK_KINDS),
        "degrees": degrees,
        "strategies": [strategies[k].label for k in assignment],
        "layouts": strategy_layouts(strategies[k] for k in sorted(set(assignment))),
        "compact": compact_notation(degrees),
    }


def strategy_layouts(strategies) -> dict[str, dict[str, Any]]:
    """What a plan file stores of its strategies' layouts (``layouts``): each whole-group
    strategy's label -> its backend and its layout's JSON form (``{"tp_backend": "atp",
    "layout": {"d1": 4, "d2": 2}}``), so a reader needs no label syntax; per-block degrees
    (``tp4``) have none."""
    return {s.label: {"tp_backend": s.family, "layout": s.layout.to_json()}
            for s in strategies if not family_of(s).mixes and s.layout is not None}


def _strategy(label: Any, stored: dict[str, Any]) -> BlockStrategy | None:
    """The strategy a plan file names ``label``: from its ``layouts`` entry, else from the label
    itself (files written before layouts were stored: ``atp4x2`` is the mesh (4, 2), ``3d8`` the
    cube of 8)."""
    if not isinstance(label, str):
        return None
    entry = stored.get(label)
    if not isinstance(entry, dict):
        return strategy_of_label(label)
    try:
        layout = Layout.from_json(entry.get("layout"), backend(entry.get("tp_backend")).layout_axes)
    except ModelingError as e:
        raise ConfigError(f"plan strategy {label!r}: {e}; plan again") from None
    return BlockStrategy(degree=layout.size, family=entry["tp_backend"], layout=layout)


def whole_model_backend(data: dict[str, Any]) -> dict[str, str] | None:
    """The backend flags of a plan that runs the whole model as one backend (``strategies`` all
    one layout of a family that does not mix with others, e.g. ``atp<d1>x<d2>`` or ``3d<T>``,
    written by ``megatron-oases plan --families ...,atp,3d``): its record's ``launch_flags``
    (``{"--tp-backend": ..., ["--atp-mesh": "d1,d2"]}``); None for a per-block (Megatron) plan."""
    labels = data.get("strategies") or []
    stored = data.get("layouts") or {}
    strategies = {lab: _strategy(lab, stored) for lab in labels}
    whole = {lab for lab, s in strategies.items() if s is not None and not family_of(s).mixes}
    if not whole:
        return None
    s = strategies[next(iter(whole))]
    if len(whole) != 1 or len(whole) != len(set(labels)) or s.layout not in family_layouts(s.family, s.degree):
        raise ConfigError(f"plan strategies {sorted(set(labels))} mix a whole-model backend (ATP mesh or "
                          f"3-D cube) with other layouts, which the runtime cannot run; plan again")
    return backend(s.family).launch_flags(s.layout)


def plan_launch_flags(data: dict[str, Any], plan_path: str) -> dict[str, str | None]:
    """The flags a plan sets on a launch command (None: remove the flag): the TP size, and
    ``--oases-plan`` or, for a whole-model plan, ``--tp-backend atp --atp-mesh d1,d2`` or
    ``--tp-backend 3d``; a ``--sequence-parallel`` plan (uniform T) removes ``--oases-plan``; and
    ``--schedule oases`` for a plan priced for it (removed for the default executor)."""
    tp = data["tensor_model_parallel_size"]
    backend = whole_model_backend(data)
    # the executor it is priced for (None: Megatron's default, the flag removed); none in older files
    schedule = {option("schedule"): None if data["schedule"] == "default" else data["schedule"]} \
        if data.get("schedule") else {}
    model = (data.get("inputs") or {}).get("model", {})
    if backend is None and (model.get("sequence_parallel") or model.get("num_experts")):
        # priced at uniform T only, and --oases-plan refuses --sequence-parallel and MoE (check_plan,
        # megatron_oases.moe): the launch is stock TP T
        return {TP_FLAG: str(tp), FLAG: None, **schedule}
    if backend is None:
        return {**_per_block_flags(tp, plan_path), **schedule}
    return {TP_FLAG: str(tp), **backend, FLAG: None, **schedule}


def _per_block_flags(tp: int, plan_path: str) -> dict[str, str | None]:
    return {TP_FLAG: str(tp), FLAG: shlex.quote(plan_path)}


def rewrite_command(cmd: str, *, tp: int | None = None, plan_path: str | None = None,
                    flags: dict[str, str | None] | None = None) -> str:
    """Set flags in a launch command line (default: ``--tensor-model-parallel-size tp`` and
    ``--oases-plan plan_path``): replace their values where present (``--flag v`` or
    ``--flag=v``; repeats removed), append them otherwise, remove those whose value is None;
    every other character stays as it was."""
    values = flags if flags is not None else _per_block_flags(tp, plan_path)
    toks = _tokens(cmd)
    edits: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    i = 0
    while i < len(toks):
        s, e, word = toks[i]
        name = word.split("=", 1)[0]
        if name in values:
            end = e
            if "=" not in word and i + 1 < len(toks):
                end = toks[i + 1][1]
                i += 1
            drop = name in seen or values[name] is None
            edits.append((s, end, "" if drop else f"{name} {values[name]}"))
            seen.add(name)
        i += 1
    out = cmd
    for s, e, text in reversed(edits):
        if not text:  # drop a repeated flag and the blank before it
            while s > 0 and out[s - 1] in " \t":
                s -= 1
        out = out[:s] + text + out[e:]
    missing = [f"{n} {v}" for n, v in values.items() if n not in seen and v is not None]
    if missing:
        stripped = out.rstrip()
        out = stripped + " " + " ".join(missing) + out[len(stripped):]
    return out


def launch_flags(flags: dict[str, str | None]) -> str:
    """``plan_launch_flags`` as a command-line fragment."""
    return " ".join(f"{n} {v}" for n, v in flags.items() if v is not None)
