"""IFEval scoring on top of a maintained checker package (if-verifiable's ``if_verifiable/ifeval``).

The checks themselves are the package's (Google's IFEval instruction checks, the same code lm-eval ships;
on the 541 GPT-4 reference responses both give the same strict and loose result for every instruction,
and if-verifiable installs 26 fewer packages: no evaluate, scikit-learn, scipy, sacrebleu or harness); this
module only

* points NLTK at the vendored ``data/ifeval/nltk_data`` before any check is imported, so nothing is
  downloaded (the checks load the punkt tokenizer from NLTK's search path);
* imports the checker submodules without ``if_verifiable/__init__.py``, which imports the package's
  dataset API and with it ``datasets`` (pyarrow, pandas), which the checks never use;
* makes the two random parts deterministic: langdetect is seeded (``DetectorFactory.seed = 0``) and
  ``keywords:letter_frequency`` counts the given character as it is when it lies outside a-z (the
  package would replace it with a random letter; the reference counts it as given);
* reads and cross-checks the input and response files, applies the strict and loose rules, and writes
  per-prompt results and a summary atomically.

Determinism: the same input files give byte-identical outputs (no timestamps in them).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from runmap.resources import data_dir
from runmap.atomic import write_text
from runmap.provenance import sha256_file

CHECKER_PACKAGE = "if-verifiable"
CHECKER_MODULE = "if_verifiable.ifeval"
LANGDETECT_SEED = 0
DATA_DIR = data_dir() / "ifeval"
NLTK_DATA_DIR = DATA_DIR / "nltk_data"
DEFAULT_INPUTS = DATA_DIR / "input_data.jsonl"
SUMMARY_KIND = "runmap.ifeval-summary"
RESULT_KIND = "runmap.ifeval-result"


class IFEvalError(ValueError):
    """Bad IFEval input: the message names the file and line (or key) at fault."""


# --------------------------------------------------------------------------- NLTK and the checks


def configure_nltk(data_dir: Path = NLTK_DATA_DIR) -> Path:
    """Put the vendored NLTK data first on NLTK's search path (and in ``NLTK_DATA`` for children).

    Must run before the checker modules are imported: their import calls ``nltk.data.find`` and
    downloads the tokenizer when it is missing. Raises IFEvalError if the vendored tokenizer is absent.
    """
    data_dir = Path(data_dir).resolve()
    punkt = data_dir / "tokenizers" / "punkt_tab" / "english"
    if not (punkt / "sent_starters.txt").is_file():
        raise IFEvalError(f"{punkt}: vendored NLTK punkt_tab tokenizer missing (see data/ifeval/PROVENANCE.md)")
    import nltk

    if str(data_dir) not in nltk.data.path:
        nltk.data.path.insert(0, str(data_dir))
    os.environ["NLTK_DATA"] = str(data_dir)
    pointer = nltk.data.find("tokenizers/punkt_tab/english/")
    found = Path(getattr(pointer, "path", str(pointer))).resolve()
    if data_dir not in found.parents:
        raise IFEvalError(f"NLTK resolves punkt_tab to {found}, not to the vendored {punkt}")
    return data_dir


def _import_checker_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """Import ``instructions`` and ``instructions_registry`` of if-verifiable's IFEval checks only.

    ``if_verifiable/__init__.py`` imports the package's dataset API (``datasets``, pyarrow, pandas: about
    a second and a half of imports), which the checks do not need, so while the submodules load,
    ``if_verifiable`` is a bare package object pointing at the installed folder. If the full package is
    already imported, it is used as is.
    """
    name = CHECKER_MODULE.split(".")[0]
    stub = None
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise IFEvalError(f"the IFEval checker package {CHECKER_PACKAGE} is not installed "
                              f"(pip install -e . installs it)")
        stub = types.ModuleType(name)
        stub.__path__ = list(spec.submodule_search_locations)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        stub.__spec__.submodule_search_locations = list(stub.__path__)
        sys.modules[name] = stub
    try:
        instructions = importlib.import_module(CHECKER_MODULE + ".instructions")
        registry = importlib.import_module(CHECKER_MODULE + ".instructions_registry")
    finally:
        if stub is not None and sys.modules.get(name) is stub:
            # leave no half package behind: a later `import if_verifiable` gets the real one (the loaded
            # submodules stay registered under their names and are reused by it)
            del sys.modules[name]
    return instructions, registry


def _letter_as_given(base: type) -> type:
    """Subclass of the package's letter-frequency check that keeps a non a-z character as given.

    The package replaces a letter outside a-z (IFEval keys 1122 ``#`` and 1129 ``!``) with a random
    one; the reference lower-cases any single character and counts it. Only the chosen letter
    changes: building the description and the counting stay the package's.
    """

    class LetterFrequencyAsGiven(base):
        def build_description(self, *, letter=None, let_frequency=None, let_relation=None):
            if not isinstance(letter, str) or len(letter.strip()) != 1:
                raise IFEvalError(f"keywords:letter_frequency needs one character, got {letter!r}")
            given = letter.strip().lower()
            # a stand-in a-z letter keeps the package off its random branch; then put the real one back
            super().build_description(letter="a", let_frequency=let_frequency, let_relation=let_relation)
            self._letter = given
            return self._description_pattern.format(
                letter=self._letter, let_frequency=self._frequency, let_relation=self._comparison_relation)

    LetterFrequencyAsGiven.__name__ = base.__name__ + "AsGiven"
    return LetterFrequencyAsGiven


def _quiet_language_errors(instructions: types.ModuleType) -> None:
    """A response whose language cannot be detected is logged at ERROR once per check by the package (and
    counted as followed, as in the reference); thousands of such lines only hide real errors. The package
    logs through the root logger (``logging.error``), which would also install a stderr handler on the
    root logger on first use, so its module-level ``logging`` is pointed at a logger of its own, silenced."""
    quiet = logging.getLogger(instructions.__name__)
    quiet.setLevel(logging.CRITICAL)
    quiet.propagate = False
    instructions.logging = types.SimpleNamespace(debug=quiet.debug, info=quiet.info, warning=quiet.warning,
                                                 error=quiet.error, exception=quiet.exception)


@dataclass(frozen=True)
class Checkers:
    """Instruction id -> checker class, plus where they came from (recorded in every summary)."""

    classes: dict
    package: str
    version: str


_CHECKERS: Checkers | None = None


def load_checkers() -> Checkers:
    """Configure NLTK and langdetect, import the package's checks once, apply the letter fix."""
    global _CHECKERS
    if _CHECKERS is None:
        configure_nltk()
        import langdetect

        langdetect.DetectorFactory.seed = LANGDETECT_SEED
        instructions, registry = _import_checker_modules()
        _quiet_language_errors(instructions)
        classes = dict(registry.INSTRUCTION_DICT)
        lf = "keywords:letter_frequency"
        classes[lf] = _letter_as_given(classes[lf])
        _CHECKERS = Checkers(classes, CHECKER_PACKAGE, importlib.metadata.version(CHECKER_PACKAGE))
    return _CHECKERS


# --------------------------------------------------------------------------- reading the files


def _jsonl_objects(path: Path):
    """Yield (line_number, object) for each line; a blank or non-object line is an error naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IFEvalError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise IFEvalError(f"{path}: not UTF-8 text ({e})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise IFEvalError(f"{path}: empty file")
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            raise IFEvalError(f"{path}:{i}: empty line")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise IFEvalError(f"{path}:{i}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise IFEvalError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
        yield i, obj


@dataclass(frozen=True)
class InputRecord:
    """One IFEval prompt. kwargs[i] are the arguments of instruction_id_list[i]."""

    key: int
    prompt: str
    instruction_id_list: tuple
    kwargs: tuple
    line: int


def load_inputs(path: Path, known_ids=None) -> list[InputRecord]:
    """Read an IFEval input file (``key``, ``prompt``, ``instruction_id_list``, ``kwargs`` per line).

    known_ids: instruction ids the checker knows; an unknown id is an error naming the line.
    """
    records, seen_keys, seen_prompts = [], {}, {}
    for i, obj in _jsonl_objects(path):
        where = f"{path}:{i}"
        for field, typ in (("key", int), ("prompt", str), ("instruction_id_list", list), ("kwargs", list)):
            if field not in obj:
                raise IFEvalError(f"{where}: missing field '{field}'")
            if not isinstance(obj[field], typ) or (typ is int and isinstance(obj[field], bool)):
                raise IFEvalError(f"{where}: field '{field}' must be {typ.__name__}")
        ids, kwargs = obj["instruction_id_list"], obj["kwargs"]
        if len(ids) != len(kwargs):
            raise IFEvalError(f"{where}: {len(ids)} instruction ids but {len(kwargs)} kwargs")
        if not ids:
            raise IFEvalError(f"{where}: empty instruction_id_list")
        for iid, kw in zip(ids, kwargs):
            if not isinstance(iid, str) or not isinstance(kw, dict):
                raise IFEvalError(f"{where}: instruction ids must be strings and kwargs objects")
            if known_ids is not None and iid not in known_ids:
                raise IFEvalError(f"{where}: unknown instruction id '{iid}'")
        if obj["key"] in seen_keys:
            raise IFEvalError(f"{where}: key {obj['key']} already on line {seen_keys[obj['key']]}")
        if obj["prompt"] in seen_prompts:
            raise IFEvalError(f"{where}: same prompt as line {seen_prompts[obj['prompt']]}")
        seen_keys[obj["key"]] = seen_prompts[obj["prompt"]] = i
        records.append(InputRecord(obj["key"], obj["prompt"], tuple(ids), tuple(kwargs), i))
    return records


def load_responses(path: Path, inputs: list[InputRecord]) -> dict[str, str]:
    """Read a response file (``prompt`` and ``response`` per line) and match it to the inputs exactly.

    Every input prompt must have exactly one response and every response one input prompt; anything
    else is an error naming the line (or, for a missing response, the input key and line), so nothing
    is ever scored short. An optional ``key`` field must agree with the input's key.
    Returns prompt -> response.
    """
    by_prompt = {r.prompt: r for r in inputs}
    out, line_of = {}, {}
    for i, obj in _jsonl_objects(path):
        where = f"{path}:{i}"
        for field in ("prompt", "response"):
            if field not in obj:
                raise IFEvalError(f"{where}: missing field '{field}'")
            if not isinstance(obj[field], str):
                raise IFEvalError(f"{where}: field '{field}' must be a string")
        prompt = obj["prompt"]
        rec = by_prompt.get(prompt)
        if rec is None:
            raise IFEvalError(f"{where}: prompt not among the inputs (extra prompt): {prompt[:80]!r}")
        if prompt in out:
            raise IFEvalError(f"{where}: second response to the prompt of line {line_of[prompt]} (key {rec.key})")
        if "key" in obj and obj["key"] != rec.key:
            raise IFEvalError(f"{where}: key {obj['key']!r} but the inputs give key {rec.key} for this prompt")
        out[prompt], line_of[prompt] = obj["response"], i
    missing = [r for r in inputs if r.prompt not in out]
    if missing:
        shown = ", ".join(f"key {r.key} (inputs line {r.line})" for r in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise IFEvalError(f"{path}: no response for {len(missing)} input prompt(s): {shown}{more}")
    return out


# --------------------------------------------------------------------------- scoring


def response_variants(response: str) -> list[str]:
    """The eight responses the loose rule tries: as is, without the first line, without the last,
    without both; and each of those with every ``*`` removed."""
    lines = response.split("\n")
    base = [
        response,
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    ]
    return base + [v.replace("*", "") for v in base]


def _build(checkers: Checkers, rec: InputRecord, index: int):
    iid = rec.instruction_id_list[index]
    inst = checkers.classes[iid](iid)
    # absent arguments are null in some copies of the data; the reference passes only present ones
    kwargs = {k: v for k, v in rec.kwargs[index].items() if v is not None}
    try:
        inst.build_description(**kwargs)
        args = inst.get_instruction_args()
        if args and "prompt" in args:
            inst.build_description(prompt=rec.prompt)
    except (TypeError, ValueError) as e:
        raise IFEvalError(f"inputs line {rec.line} (key {rec.key}): instruction '{iid}': {e}") from None
    return inst


def _follows(inst, response: str) -> bool:
    # an empty (whitespace-only) response follows nothing, as in the reference
    return bool(response.strip()) and bool(inst.check_following(response))


def score_prompt(checkers: Checkers, rec: InputRecord, response: str) -> dict:
    """Strict and loose follow lists for one prompt (one entry per instruction)."""
    strict, loose = [], []
    variants = response_variants(response)
    for index in range(len(rec.instruction_id_list)):
        # Any randomness left in a check (there is none with complete kwargs) is pinned per prompt.
        random.seed(rec.key)
        inst = _build(checkers, rec, index)
        strict.append(_follows(inst, response))
        loose.append(any(_follows(inst, v) for v in variants))
    return {
        "kind": RESULT_KIND,
        "key": rec.key,
        "prompt": rec.prompt,
        "instruction_id_list": list(rec.instruction_id_list),
        "strict": {"follow_all_instructions": all(strict), "follow_instruction_list": strict},
        "loose": {"follow_all_instructions": all(loose), "follow_instruction_list": loose},
    }


def _acc(followed: int, total: int) -> dict:
    return {"followed": followed, "total": total, "accuracy": round(followed / total, 6) if total else None}


def summarize(results: list[dict]) -> dict:
    """Prompt- and instruction-level accuracy, strict and loose, and the per-type breakdowns."""
    summary = {"prompt_level": {}, "instruction_level": {}}
    for mode in ("strict", "loose"):
        summary["prompt_level"][mode] = _acc(
            sum(r[mode]["follow_all_instructions"] for r in results), len(results))
        flat = [f for r in results for f in r[mode]["follow_instruction_list"]]
        summary["instruction_level"][mode] = _acc(sum(flat), len(flat))
    for name, group in (("by_instruction", lambda iid: iid), ("by_category", lambda iid: iid.split(":")[0])):
        counts: dict = {}
        for r in results:
            for j, iid in enumerate(r["instruction_id_list"]):
                c = counts.setdefault(group(iid), {"total": 0, "strict": 0, "loose": 0})
                c["total"] += 1
                c["strict"] += r["strict"]["follow_instruction_list"][j]
                c["loose"] += r["loose"]["follow_instruction_list"][j]
        summary[name] = OrderedDict(
            (k, {"total": c["total"], "strict": _acc(c["strict"], c["total"]), "loose": _acc(c["loose"], c["total"])})
            for k, c in sorted(counts.items()))
    return summary


def sidecar_path(responses: Path) -> Path:
    """Where ``runmap ifeval generate`` writes the metadata of a response file."""
    responses = Path(responses)
    return responses.with_name(responses.name + ".meta.json")


def _read_generation(meta: Path) -> dict:
    """The generation sidecar ``meta`` as a dict; IFEvalError naming the file if it is not one."""
    try:
        generation = json.loads(Path(meta).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise IFEvalError(f"{meta}: cannot read generation metadata ({e})") from None
    if not isinstance(generation, dict):
        raise IFEvalError(f"{meta}: generation metadata must be a JSON object")
    return generation


def score_files(inputs: Path, responses: Path, meta: Path | None = None, progress: bool = False,
                limit: int | None = None):
    """Score ``responses`` against ``inputs``. Returns (per-prompt results, summary dict).

    meta: generation sidecar; defaults to ``sidecar_path(responses)`` when that file exists.
    limit: score the first ``limit`` input prompts only (``runmap ifeval generate --limit``); default: the limit
    the sidecar records, else every prompt.
    """
    checkers = load_checkers()
    recs = load_inputs(inputs, known_ids=checkers.classes)
    if meta is None and sidecar_path(responses).is_file():
        meta = sidecar_path(responses)
    generation = _read_generation(meta) if meta is not None else None
    recorded = (generation.get("inputs") or {}).get("limit") if generation is not None else None
    recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0 else None
    if limit is not None and recorded is not None and limit != recorded:
        raise IFEvalError(f"{meta}: the responses answer the first {recorded} prompts (generate --limit {recorded}); "
                          f"--limit {limit} asks for {limit}")
    limit = recorded if limit is None else limit
    if limit is not None:
        recs = recs[:limit]
    answers = load_responses(responses, recs)
    it = recs
    if progress:
        from tqdm import tqdm

        it = tqdm(recs, desc="ifeval score", unit="prompt", file=sys.stderr)
    results = [score_prompt(checkers, r, answers[r.prompt]) for r in it]
    if generation is not None:
        if generation.get("status") != "complete":
            raise IFEvalError(f"{meta}: generation status is {generation.get('status')!r}, not 'complete'; "
                              f"rerun `runmap ifeval generate` with the same arguments to finish it")
        # the sha256 of the whole inputs file generate read: a --limit run may be scored against those inputs cut to
        # its prompts (a file of the first N lines), so there only the prompts themselves are matched
        want = generation.get("inputs", {}).get("sha256")
        if want is not None and generation.get("inputs", {}).get("limit") is None and want != sha256_file(inputs):
            raise IFEvalError(f"{meta}: responses were generated from other inputs (sha256 {want[:12]}...)")
    summary = {
        "kind": SUMMARY_KIND,
        "version": 1,
        "inputs": {"path": str(inputs), "sha256": sha256_file(inputs), "prompts": len(recs),
                   **({} if limit is None else {"limit": limit})},
        "responses": {"path": str(responses), "sha256": sha256_file(responses)},
        "checker": {
            "package": checkers.package,
            "version": checkers.version,
            "module": CHECKER_MODULE,
            "langdetect_seed": LANGDETECT_SEED,
            "nltk_data": "data/ifeval/nltk_data (vendored punkt_tab)",
            "letter_frequency": "a character outside a-z is counted as given (reference behaviour)",
            "loose_variants": 8,
        },
        **summarize(results),
        "generation": _generation_record(generation, meta),
    }
    return results, summary


def _generation_record(meta: dict | None, path) -> dict | None:
    """The parts of the generation sidecar a summary keeps (model, pack, executor, regime, settings)."""
    if meta is None:
        return None
    keep = ("model", "pack", "executor", "regime", "resident", "generation", "timing", "status", "counts",
            "device", "max_seq_len", "engine_load_s", "command")
    return {"sidecar": str(path), **{k: meta.get(k) for k in keep if k in meta}}


# --------------------------------------------------------------------------- writing


def write_outputs(out_dir: Path, results: list[dict], summary: dict) -> tuple[Path, Path]:
    """``out_dir/results.jsonl`` (one line per prompt) and ``out_dir/summary.json``, each atomic."""
    out_dir = Path(out_dir)
    res_path, sum_path = out_dir / "results.jsonl", out_dir / "summary.json"
    write_text(res_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    write_text(sum_path, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return res_path, sum_path


def format_table(summary: dict) -> str:
    lines = ["level        strict               loose"]
    for level in ("prompt_level", "instruction_level"):
        s, lo = summary[level]["strict"], summary[level]["loose"]
        lines.append(
            f"{level.split('_')[0]:<12} {s['followed']:>4}/{s['total']:<4} {100 * (s['accuracy'] or 0):6.2f} %"
            f"   {lo['followed']:>4}/{lo['total']:<4} {100 * (lo['accuracy'] or 0):6.2f} %")
    return "\n".join(lines)
