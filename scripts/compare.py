#!/usr/bin/env python3
"""Speedup and loss parity of each run against the stock baseline, from training logs: a table, a
CSV, a PNG chart.

    python scripts/compare.py RESULTS_DIR [--csv OUT.csv] [--png OUT.png]
    python scripts/compare.py stock=a.log atp=b.jsonl oases=c.log [--baseline stock]

Reads two log formats, line by line (a file may mix them; an iteration logged twice counts once):

* ``megatron-oases train --log-json FILE``: one JSON object per iteration with ``iteration`` and
  ``step_ms`` (and ``lm_loss``, ``tflops_per_rank``, ``tokens_per_s``);
* Megatron-LM's stdout (and the reference trainer's): `` iteration k/ N | ... elapsed time per
  iteration (ms): X`` (and ``lm loss: L``, ``throughput per GPU (TFLOP/s/GPU): Y`` or
  ``TFLOP/s per rank: Y``).

A directory argument takes every ``*.log`` / ``*.jsonl`` below it; a file's case is its parent
directory relative to the argument (``RESULTS/h4096/oases.log``: case ``h4096``, variant
``oases``), so one results directory of the SLURM scripts (docs/megatron_lm.md) gives one row per
run with speedups against the variant named ``--baseline`` (default ``stock``) of the same case.

Every run gets a status:

* ``complete``: it logged its last iteration (N from `` iteration k/ N |``, Megatron-LM's
  ``train_iters`` argument or a sidecar args file; when N is unknown, the longest run of its case);
* ``incomplete (k of N iterations)``: it stopped early without an error in its log;
* ``crashed``: a traceback, an ``error:`` / ``...Error:`` line or a non-zero exit code in its log
  (or in the results directory's ``status.txt``), or no iteration at all.

A speedup is computed only between complete runs, over the iterations both logged, after the
first ``--skip-first`` of them (default 1: warm-up); otherwise its cell says why. The loss column
is the largest relative difference ``|loss - baseline loss| / |baseline loss|`` over every
iteration both runs logged a loss for (warm-up included; a crashed run up to its crash): parity
holds at the same layout and seed, so a run whose ``seed`` argument differs from the baseline's
says so instead.

Timings of CPU ranks say little about GPU speedups: a line after the table names the runs whose
log shows CPU ranks: the start-up line of both entries (``megatron_oases: model ... | cpu, gloo``,
``specs.build_line``), a ``device`` argument of ``cpu``, or Megatron-LM's ``distributed_backend``
``gloo`` (the entry's only backend on CPU; GPU runs use nccl). Lines after the
table name the cause of every missing speedup and warn when runs of one case differ in
``transformer_impl``, precision or model flags, as far as the logs show them: Megatron-LM prints its
arguments block; for the reference trainer, a sidecar ``<variant>.args.json`` next to the log
(a mapping of argument names to values, or the command line as a list of strings) is read;
without either nothing is compared. A ``<variant>.out`` next to a ``<variant>.jsonl`` is read as
that run's stdout/stderr: for a crash and N, not for iterations.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

PROG = "compare.py"
LOG_SUFFIXES = (".log", ".jsonl")
"""What a directory argument picks up (any file can be named explicitly)."""
STDOUT_SUFFIX = ".out"
"""``<variant>.out`` next to ``<variant>.jsonl``: the run's stdout/stderr, read for a crash and N."""
SIDECAR_SUFFIX = ".args.json"
"""``<variant>.args.json`` next to ``<variant>.log`` / ``.jsonl``: the run's arguments."""

_PREFIX = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s?|\d+:\s)")  # torchrun --tee / srun -l prefixes
_STEP = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")
_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_TFLOPS = re.compile(r"(?:throughput per GPU \(TFLOP/s/GPU\)|TFLOP/s per rank):\s*([0-9.eE+-]+)")
_TOKENS = re.compile(r"tokens/s:\s*([0-9.eE+-]+)")
_LOSS = re.compile(r"\blm loss:\s*([-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|inf))", re.I)
_BUILD_DEVICE = re.compile(r"^megatron_oases: model .*\|\s*(cpu|cuda), \w+\s*$")
"""``specs.build_line``, printed at start-up by both entries: its last field is the device."""
_ARGS_BEGIN = re.compile(r"-{3,} arguments -{3,}")
_ARGS_END = re.compile(r"-{3,} end of arguments -{3,}")
_ARG_LINE = re.compile(r"^\s*(\w+) \.{2,} ?(.*?)\s*$")
_CRASH = [
    re.compile(r"^Traceback \(most recent call last\)"),
    re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception)(?::|$)"),  # RuntimeError: ..., ChildFailedError:
    re.compile(r"(?:^|\s)\S+: error: "),                     # pretrain_gpt.py: error:, srun: error:
    re.compile(r"^megatron-oases \w+: (?:error: |rank\(s\) )"),  # our CLIs, the trainer's launcher
    re.compile(r"^ERROR:"),                                  # torchrun's elastic agent
    re.compile(r"\bexitcode\s*:\s*-?[1-9]\d*"),              # torchrun's failure summary
    re.compile(r"\b[Ee]xit(?:ed with)? (?:code|status)[: ]\s*-?[1-9]\d*"),
    re.compile(r"\b(?:exit|rc)=-?[1-9]\d*\b"),
]
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): |(?:^|\s)\S+: error: ")
MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
              "max_position_embeddings", "micro_batch_size", "global_batch_size", "vocab_size",
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
              "recompute_granularity", "recompute_method", "recompute_num_layers", "normalization",
              "swiglu", "untie_embeddings_and_output_weights", "position_embedding_type")
"""Arguments that change the work of an iteration; runs compared with each other should agree."""


@dataclass
class LogData:
    """What one log shows: per-iteration numbers, the announced length, a crash, the arguments."""

    iterations: dict[int, dict] = field(default_factory=dict)
    """iteration number -> {"step_ms", "tflops", "tokens_per_s", "loss"} (first record of each
    number)."""
    total: int | None = None
    """N of `` iteration k/ N |`` (or the ``train_iters`` argument)."""
    crash: str | None = None
    """The first line that shows a failure."""
    settings: dict[str, str] = field(default_factory=dict)
    """Megatron-LM's arguments block, as printed (strings)."""
    device: str | None = None
    """"cpu" / "cuda" from the start-up line, where the log has one."""

    @property
    def step_ms(self) -> list[float]:
        return [self.iterations[i]["step_ms"] for i in sorted(self.iterations)]


@dataclass
class Run:
    """One training run: its log, where it comes from, and its status."""

    case: str
    variant: str
    path: str
    log: LogData
    total_source: str = ""
    """Where N comes from: "log", "args", "longest run of its case" or "" (unknown)."""
    status: str = ""
    """complete | incomplete | crashed."""
    detail: str = ""
    """The status as shown: ``incomplete (6 of 20 iterations)``, ``crashed at iteration 6 of 20``."""

    @property
    def last(self) -> int:
        return max(self.log.iterations, default=0)

    def values(self, key: str, skip: int) -> list[float]:
        vals = [self.log.iterations[i][key] for i in sorted(self.log.iterations)
                if self.log.iterations[i].get(key) is not None]
        # Keep at least the last value when a short run has no more than `skip` iterations.
        return vals[skip:] if len(vals) > skip else vals[-1:]


class CompareError(Exception):
    """Bad input: one line on stderr, exit 2 (the project's convention for a refused input)."""


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def parse_log(text: str) -> LogData:
    """Iterations (step ms, TFLOP/s, tokens/s), the announced total, a crash line, the arguments."""
    data = LogData()
    in_args = False
    markers: list[str] = []
    exception = ""
    seq = 0  # numbering of step lines that carry no iteration number
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.rstrip())
        s = line.strip()
        if in_args:
            if _ARGS_END.search(s):
                in_args = False
            elif (m := _ARG_LINE.match(line)):
                data.settings.setdefault(m.group(1), m.group(2))
            continue
        if _ARGS_BEGIN.search(s) and not _ARGS_END.search(s):
            in_args = True
            continue
        if s.startswith("{"):
            try:
                rec = json.loads(s)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict) and _num(rec.get("step_ms")) is not None:
                it = rec.get("iteration")
                it = int(it) if _num(it) is not None else seq + 1
                seq = max(seq, it)
                data.iterations.setdefault(it, {"step_ms": float(rec["step_ms"]),
                                                "tflops": _num(rec.get("tflops_per_rank")),
                                                "tokens_per_s": _num(rec.get("tokens_per_s")),
                                                "loss": _num(rec.get("lm_loss"))})
                continue
        m = _STEP.search(line)
        if m:
            im = _ITER.search(line)
            if im:
                it = int(im.group(1))
                data.total = max(data.total or 0, int(im.group(2)))
            else:
                it = seq + 1
            seq = max(seq, it)
            t, k, loss = _TFLOPS.search(line), _TOKENS.search(line), _LOSS.search(line)
            data.iterations.setdefault(it, {"step_ms": float(m.group(1)),
                                            "tflops": float(t.group(1)) if t else None,
                                            "tokens_per_s": float(k.group(1)) if k else None,
                                            "loss": float(loss.group(1)) if loss else None})
            continue
        if (d := _BUILD_DEVICE.match(s)):
            data.device = data.device or d.group(1)
            continue
        if any(p.search(s) for p in _CRASH):
            markers.append(s[:160])
            if _EXCEPTION.search(s) and not exception:
                exception = s[:160]
    # The exception itself (``torch.OutOfMemoryError: ...``) says more than ``Traceback ...``.
    data.crash = exception or (markers[0] if markers else None)
    return data


# ---- runs, arguments, status --------------------------------------------------------------------

def read_sidecar(log_path: Path) -> dict[str, str] | None:
    """The arguments in ``<stem>.args.json`` next to a log: a mapping, or a command line as a list
    (``--flag value`` / ``--switch``), as strings keyed by Megatron's argument names."""
    path = log_path.with_name(log_path.stem + SIDECAR_SUFFIX)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CompareError(f"{path}: cannot be read as JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("argv"), list):
        data = data["argv"]
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out[str(k).lstrip("-").replace("-", "_")] = str(v)
    elif isinstance(data, list) and all(isinstance(x, str) for x in data):
        i = 0
        while i < len(data):
            tok = data[i]
            if tok.startswith("--"):
                key = tok[2:].replace("-", "_")
                if "=" in key:
                    key, _, val = key.partition("=")
                    out[key] = val
                elif i + 1 < len(data) and not data[i + 1].startswith("--"):
                    out[key] = data[i + 1]
                    i += 1
                else:
                    out[key] = "True"
            i += 1
    else:
        raise CompareError(f"{path}: must be a JSON mapping of arguments or a list of "
                           "command-line words")
    return out


def precision(settings: dict[str, str]) -> str | None:
    """bf16 / fp16 / fp32 from the arguments, None when they do not say."""
    flags = {k: settings.get(k) for k in ("bf16", "fp16")}
    if all(v is None for v in flags.values()) and "params_dtype" not in settings:
        return None
    for name, v in flags.items():
        if v is not None and v.strip().lower() in ("true", "1", "yes"):
            return name
    dtype = settings.get("params_dtype", "")
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(dtype, "fp32")


def read_status_file(root: Path) -> dict[tuple[str, str], int]:
    """``status.txt`` of a SLURM results directory: ``case variant exit=rc`` per run."""
    out = {}
    path = root / "status.txt"
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            m = re.match(r"^\s*(\S+)\s+(\S+)\s+exit=(-?\d+)\s*$", line)
            if m:
                out[m.group(1), m.group(2)] = int(m.group(3))
    return out


def collect(specs: list[str]) -> list[Run]:
    """Runs from ``FILE``, ``LABEL=FILE`` or ``DIRECTORY`` arguments, with their status."""
    runs = []
    for spec in specs:
        label, path = "", Path(spec)
        if "=" in spec and not path.exists():
            label, _, rest = spec.partition("=")
            path = Path(rest)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)
            if not files:
                raise CompareError(f"no *.log / *.jsonl files under {path}")
            codes = read_status_file(path)
            for f in files:
                rel = f.parent.relative_to(path)
                case = "" if str(rel) == "." else str(rel)
                run = _read(f, case=case, variant=f.stem)
                rc = codes.get((case or "-", f.stem), codes.get((case, f.stem)))
                if rc and run.log.crash is None:
                    run.log.crash = f"exit={rc} in {path / 'status.txt'}"
                runs.append(run)
        elif path.is_file():
            runs.append(_read(path, case="", variant=label or path.stem))
        else:
            raise CompareError(f"{path} is neither a log file nor a directory")
    assign_status(runs)
    return runs


def _read(path: Path, *, case: str, variant: str) -> Run:
    log = parse_log(path.read_text(encoding="utf-8", errors="replace"))
    stdout = path.with_suffix(STDOUT_SUFFIX)
    if path.suffix == ".jsonl" and stdout.is_file():
        # The run's stdout/stderr next to its --log-json file: its crash and N, not its iterations.
        side = parse_log(stdout.read_text(encoding="utf-8", errors="replace"))
        log.crash = log.crash or side.crash
        log.total = log.total or side.total
        log.device = log.device or side.device
    sidecar = read_sidecar(path)
    if sidecar:
        # A run's arguments without --bf16 / --fp16 ran in fp32 (both trainers' default).
        for k, v in {"bf16": "False", "fp16": "False", **sidecar}.items():
            log.settings.setdefault(k, v)
    run = Run(case=case, variant=variant, path=str(path), log=log)
    if log.total:
        run.total_source = "log"
    elif (n := log.settings.get("train_iters", "")).isdigit() and int(n) > 0:
        log.total, run.total_source = int(n), "args"
    return run


def on_cpu(log: LogData) -> bool:
    """Whether the log shows CPU ranks (the start-up line, a ``device`` argument, or Megatron-LM's
    ``distributed_backend gloo``); see the module's docstring."""
    device = log.device or log.settings.get("device")
    if device in ("cpu", "cuda"):
        return device == "cpu"
    return log.settings.get("distributed_backend") == "gloo"


def _log_interval(iters: list[int]) -> int:
    gaps = [b - a for a, b in zip(iters, iters[1:]) if b > a]
    return min(gaps) if gaps else 1


def assign_status(runs: list[Run]) -> None:
    """complete / incomplete (k of N iterations) / crashed, for every run."""
    longest: dict[str, int] = {}
    for r in runs:
        longest[r.case] = max(longest.get(r.case, 0), r.last)
    for r in runs:
        if r.log.total is None and longest[r.case]:
            r.log.total, r.total_source = longest[r.case], "longest run of its case"
        n, k = r.log.total, r.last
        of_n = f" of {n}" if n else ""
        if not r.log.iterations:
            r.status = "crashed"
            r.detail = "crashed before iteration 1" if r.log.crash else "crashed (no iteration logged)"
        elif r.log.crash:
            r.status, r.detail = "crashed", f"crashed at iteration {k}{of_n}"
        elif n and n - k >= _log_interval(sorted(r.log.iterations)):
            r.status, r.detail = "incomplete", f"incomplete ({k}{of_n} iterations)"
        else:
            r.status, r.detail = "complete", "complete"


# ---- table rows ---------------------------------------------------------------------------------

def summarise(runs: list[Run], *, baseline: str, skip_first: int) -> list[dict]:
    """One row per run: status, step ms, TFLOP/s, tokens/s, speedup over the baseline (or why not)."""
    rows = []
    for r in runs:
        steps = r.values("step_ms", skip_first) if r.log.iterations else []
        rows.append({
            "case": r.case, "variant": r.variant, "file": r.path, "status": r.status,
            "status_detail": r.detail, "iterations": len(r.log.iterations),
            "expected_iterations": r.log.total or "", "last_iteration": r.last,
            "step_ms_mean": statistics.fmean(steps) if steps else math.nan,
            "step_ms_median": statistics.median(steps) if steps else math.nan,
            "step_ms_std": statistics.pstdev(steps) if len(steps) > 1 else 0.0 if steps else math.nan,
            "tflops": _mean(r.values("tflops", skip_first)),
            "tokens_per_s": _mean(r.values("tokens_per_s", skip_first)),
            "baseline": "", "speedup": math.nan, "speedup_note": "", "compared_iterations": 0,
            "loss_rel_diff": math.nan, "loss_note": "", "loss_iterations": 0,
            "device": "cpu" if on_cpu(r.log) else "", "crash_line": r.log.crash or "", "_run": r})
    ordered = []
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        group.sort(key=lambda r: r["variant"] != baseline)  # baseline first, others as given
        base = group[0] if group[0]["variant"] == baseline else None
        for r in group:
            _speedup(r, base, skip_first)
            _loss_parity(r, base)
        ordered += group
    return ordered


def _speedup(row: dict, base: dict | None, skip_first: int) -> None:
    if row["status"] != "complete":
        row["speedup_note"] = row["status"]
        return
    if base is None:
        row["speedup_note"] = "no baseline"
        return
    if base["status"] != "complete":
        row["speedup_note"] = f"baseline {base['status']}"
        return
    b, r = base["_run"].log.iterations, row["_run"].log.iterations
    common = sorted(set(b) & set(r))[skip_first:]
    if not common:
        row["speedup_note"] = "no common iterations after warm-up"
        return
    row["baseline"] = base["variant"]
    row["compared_iterations"] = len(common)
    row["speedup"] = (statistics.fmean(b[i]["step_ms"] for i in common)
                      / statistics.fmean(r[i]["step_ms"] for i in common))


def _loss_parity(row: dict, base: dict | None) -> None:
    """The largest relative loss difference from the baseline over the iterations both logged a
    loss for; or, in ``loss_note``, why there is none."""
    if base is None or row is base:
        return
    s, bs = row["_run"].log.settings, base["_run"].log.settings
    if s.get("seed") is not None and bs.get("seed") is not None and s["seed"] != bs["seed"]:
        row["loss_note"] = f"seed {s['seed']} vs {bs['seed']}"
        return
    b, r = base["_run"].log.iterations, row["_run"].log.iterations
    common = [i for i in sorted(set(b) & set(r))
              if b[i].get("loss") is not None and r[i].get("loss") is not None]
    if not common:
        row["loss_note"] = "no losses in common"
        return
    pairs = [(r[i]["loss"], b[i]["loss"]) for i in common]
    if not all(math.isfinite(x) and math.isfinite(y) for x, y in pairs):
        row["loss_note"] = "non-finite loss"
        return
    row["loss_iterations"] = len(common)
    row["loss_rel_diff"] = max(abs(x - y) / abs(y) if y else (0.0 if x == y else math.inf)
                               for x, y in pairs)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def loss_cell(row: dict) -> str:
    value = row["loss_rel_diff"]
    if math.isnan(value):
        return row["loss_note"] or "-"
    return "0" if value == 0 else f"{value:.1e}"


def speedup_cell(row: dict) -> str:
    return f"{row['speedup']:.3f}x" if not math.isnan(row["speedup"]) else row["speedup_note"] or "-"


def format_table(rows: list[dict], baseline: str) -> str:
    head = ["case", "variant", "status", "iters", "step ms", "+-", "TFLOP/s", "tokens/s",
            f"loss vs {baseline}", f"vs {baseline}"]
    body = [[r["case"] or "-", r["variant"], r["status_detail"],
             f"{r['iterations']}/{r['expected_iterations'] or '?'}",
             _fmt(r["step_ms_mean"], ".1f"), _fmt(r["step_ms_std"], ".1f"), _fmt(r["tflops"], ".3g"),
             _fmt(r["tokens_per_s"], ".0f"), loss_cell(r), speedup_cell(r)]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(out + footer(rows, baseline))


def footer(rows: list[dict], baseline: str) -> list[str]:
    """The cause of every missing speedup, notes on how N was judged, argument mismatches."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        name = case or "-"
        base = next((r for r in group if r["variant"] == baseline), None)
        if base is None:
            out.append(f"no '{baseline}' run in case {name}: no speedups in this case "
                       f"(choose another baseline with --baseline)")
        elif base["status"] != "complete":
            why = f": {base['crash_line']}" if base["crash_line"] else ""
            out.append(f"baseline {baseline} {base['status_detail']} in case {name}{why} "
                       f"({base['file']}); no speedups in this case")
        for r in group:
            if r is base and r["status"] != "complete":
                continue
            if r["status"] != "complete":
                why = f": {r['crash_line']}" if r["crash_line"] else ""
                out.append(f"{name}/{r['variant']} {r['status_detail']}{why} ({r['file']})")
            elif r["speedup_note"] == "no common iterations after warm-up":
                out.append(f"{name}/{r['variant']}: no iteration in common with {baseline} after the "
                           f"warm-up iterations (--skip-first); no speedup")
            if r["_run"].total_source == "longest run of its case" and len(group) > 1 \
                    and r["status"] == "incomplete":
                out.append(f"note: {name}/{r['variant']}: the log does not say how many iterations "
                           f"were planned; judged against the longest run of case {name}")
        out += settings_warnings(group, baseline)
    return out + cpu_caveat(rows)


def cpu_caveat(rows: list[dict]) -> list[str]:
    """One line when any timing comes from CPU ranks (``on_cpu``)."""
    names = [f"{r['case'] or '-'}/{r['variant']}" for r in rows if r["device"] == "cpu"]
    if not names:
        return []
    which = "every run" if len(names) == len(rows) else ", ".join(names)
    return [f"note: CPU timings ({which}): step times of CPU ranks do not predict GPU step "
            f"times or speedups (loss parity does not depend on the device)"]


def settings_warnings(group: list[dict], baseline: str) -> list[str]:
    """A line per run whose transformer_impl, precision or model flags differ from the baseline's
    (or, without a baseline, from the first run's) where both logs show them."""
    ref = next((r for r in group if r["variant"] == baseline), group[0])
    ref_s = ref["_run"].log.settings
    out = []
    for r in group:
        if r is ref or not ref_s or not r["_run"].log.settings:
            continue
        s, diffs = r["_run"].log.settings, []
        for key in ("transformer_impl",):
            if key in s and key in ref_s and s[key] != ref_s[key]:
                diffs.append(f"{key} {s[key]} vs {ref_s[key]}")
        p, q = precision(s), precision(ref_s)
        if p and q and p != q:
            diffs.append(f"precision {p} vs {q}")
        for key in MODEL_KEYS:
            if key in s and key in ref_s and s[key] != ref_s[key]:
                diffs.append(f"{key} {s[key]} vs {ref_s[key]}")
        if diffs:
            out.append(f"warning: {r['case'] or '-'}/{r['variant']} differs from {ref['variant']}: "
                       + ", ".join(diffs) + " (its speedup compares different work)")
    return out


CSV_COLUMNS = ["case", "variant", "status", "status_detail", "iterations", "expected_iterations",
               "compared_iterations", "step_ms_mean", "step_ms_median", "step_ms_std", "tflops",
               "tokens_per_s", "speedup", "speedup_note", "baseline", "loss_rel_diff", "loss_note",
               "loss_iterations", "device", "crash_line", "file"]


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v)
                        for k, v in r.items()})


# ---- chart --------------------------------------------------------------------------------------

def chart_data(rows: list[dict]) -> dict:
    """What the PNG draws: one bar per run, grouped by case. A run with a speedup is a solid bar of
    that height labelled ``1.24x``; any other run is a hatched, unfilled bar spanning the axis with
    its reason as the label (``crashed at iteration 6 of 20``), never a bar of height 0."""
    cases = list(dict.fromkeys(r["case"] or "-" for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / max(len(variants), 1)
    speedups = [r["speedup"] for r in rows if not math.isnan(r["speedup"])]
    top = max(speedups + [1.0]) * 1.15
    bars = []
    for r in rows:
        k, i = cases.index(r["case"] or "-"), variants.index(r["variant"])
        has = not math.isnan(r["speedup"])
        bars.append({"case": r["case"] or "-", "variant": r["variant"], "status": r["status"],
                     "x": k + (i - (len(variants) - 1) / 2) * width, "width": width,
                     "speedup": r["speedup"] if has else None,
                     "height": r["speedup"] if has else top, "hatched": not has,
                     "label": f"{r['speedup']:.2f}x" if has else
                              (r["status_detail"] if r["status"] != "complete" else r["speedup_note"])})
    return {"cases": cases, "variants": variants, "bars": bars, "ymax": top * 1.05}


def write_png(rows: list[dict], path: str, baseline: str, title: str | None) -> bool:
    """Grouped bars of speedup per case (``chart_data``); False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{PROG}: note: matplotlib is not installed; skipped {path} "
              f"(pip install matplotlib for the chart)", file=sys.stderr)
        return False
    data = chart_data(rows)
    colors = {v: f"C{i % 10}" for i, v in enumerate(data["variants"])}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(data["cases"]) * max(len(data["variants"]), 2) / 2), 4))
    labelled = set()
    for b in data["bars"]:
        c = colors[b["variant"]]
        lab = None if b["variant"] in labelled else b["variant"]
        labelled.add(b["variant"])
        if b["hatched"]:
            ax.bar(b["x"], b["height"], b["width"], facecolor="none", edgecolor=c, hatch="//", label=lab)
            ax.text(b["x"], b["height"] / 2, b["label"], rotation=90, ha="center", va="center",
                    fontsize="x-small", backgroundcolor="white")
        else:
            ax.bar(b["x"], b["height"], b["width"], color=c, label=lab)
            ax.text(b["x"], b["height"], b["label"], ha="center", va="bottom", fontsize="x-small")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(0, data["ymax"])
    ax.set_xticks(range(len(data["cases"])), data["cases"])
    ax.set_ylabel(f"speedup over {baseline} (step time)")
    ax.set_title(title or f"speedup over {baseline}; hatched: no speedup (reason written)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="log file, LABEL=FILE, or a results directory (<case>/<variant>.log)")
    p.add_argument("--baseline", default="stock", help="variant the speedups are relative to")
    p.add_argument("--skip-first", type=int, default=1, metavar="N",
                   help="leave out the first N iterations both runs logged (warm-up)")
    p.add_argument("--csv", metavar="OUT", help="write the table as CSV")
    p.add_argument("--png", metavar="OUT", help="write a bar chart of the speedups (matplotlib)")
    p.add_argument("--title", default=None, help="chart title")
    args = p.parse_args(argv)
    if args.skip_first < 0:
        p.error(f"--skip-first must be >= 0 (got {args.skip_first})")
    try:
        rows = summarise(collect(args.runs), baseline=args.baseline, skip_first=args.skip_first)
    except CompareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, args.baseline))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png and write_png(rows, args.png, args.baseline, args.title):
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
