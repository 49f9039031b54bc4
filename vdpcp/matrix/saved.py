"""A saved case: a microbatch spec plus what it needs to run (and fail) again, in one hand-readable file.

    {"name": "no-even-pad", "images": [[8, 8]], "patch_dim": 4, "seed": 0,
     "case": {"cp": 4, "even_pad": false},
     "expect": {"signature": "error: raised ValueError: pixel shuffle needs an even patch grid, got #x#"}}

``case`` holds the Case fields that differ from their defaults (cp, dp, tp, impl, split, loss, dtype,
even_pad, mutant, tower, vision_dp_over_cp, config_cp, grads); ``expect.signature`` is how it failed when saved
(vdpcp.tools.fuzz.signature). Both are optional: a plain microbatch spec is a saved case with neither, whose CP
size comes from the command line or a ``-cp<N>`` tag (as vdpcp.tools.capture and vdpcp.tools.fuzz write it) on the file's
name or its spec's ``name``. Where a file says its CP size more than once (``case.cp``, the tags), the sizes
must agree: a file that disagrees with itself is rejected, naming the file and both sizes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from vdpcp.feature.spec import MicrobatchSpec, SpecError, read_json
from vdpcp.matrix.case import PIXELS, Case

CASE_TYPES = {"cp": int, "dp": int, "tp": int, "config_cp": int, "impl": str, "split": str, "loss": str, "dtype": str,
              "mutant": str, "tower": str, "pixels": str, "even_pad": bool, "vision_dp_over_cp": bool, "grads": bool}
_DEFAULTS = {f.name: f.default for f in fields(Case) if f.name not in ("spec", "cp")}
_CP_TAG = re.compile(r"(?:^|-)cp(\d+)$")


@dataclass(frozen=True)
class Saved:
    spec: MicrobatchSpec
    case: dict  # Case fields, cp included when the file says it
    signature: str | None = None

    def to_case(self, **overrides) -> Case:
        """The case the file describes; ``overrides`` (not None) win, as flags typed on a command line do."""
        fields_ = {**self.case, **{k: v for k, v in overrides.items() if v is not None}}
        if "cp" not in fields_:
            raise SpecError(f"{self.spec.name}: no CP size: the file has no case.cp and its name no -cp<N> tag; pass --cp N")
        return Case(self.spec, **fields_)


def load(path: str | Path) -> Saved:
    """A saved case or a plain spec; SpecError naming the file and field on anything malformed."""
    path = Path(path)
    data = read_json(path)
    case = data.pop("case", {}) if isinstance(data, dict) else {}
    expect = data.pop("expect", {}) if isinstance(data, dict) else {}
    spec = MicrobatchSpec.from_dict(data, source=str(path))
    if not isinstance(case, dict) or not isinstance(expect, dict):
        raise SpecError(f"{path}: fields 'case' and 'expect' must be JSON objects")
    unknown = sorted(set(case) - set(CASE_TYPES))
    if unknown:
        raise SpecError(f"{path}: field 'case' has unknown key(s) {unknown}; expected some of {sorted(CASE_TYPES)}")
    for key, value in case.items():
        expected = CASE_TYPES[key]
        if value is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            raise SpecError(f"{path}: field 'case.{key}' = {value!r}: expected {expected.__name__}")
    if case.get("pixels", "tower") not in PIXELS:
        raise SpecError(f"{path}: field 'case.pixels' = {case['pixels']!r}: expected one of {', '.join(PIXELS)}")
    cp = _one_cp(path, case.get("cp"), _tags(path, spec))
    case = case if cp is None else {**case, "cp": cp}
    signature = expect.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise SpecError(f"{path}: field 'expect.signature' must be a string, got {signature!r}")
    return Saved(spec, case, signature)


def _tags(path: Path, spec: MicrobatchSpec) -> dict[str, int]:
    """The CP sizes a file's name and its spec's name carry as ``-cp<N>`` tags, each said as where it is."""
    found = {"the file name": cp_from_name(path.stem), "field 'name'": cp_from_name(spec.name)}
    return {f"{where} (tag -cp{cp})": cp for where, cp in found.items() if cp is not None}


def _one_cp(path: Path, case_cp: int | None, tags: dict[str, int]) -> int | None:
    """The one CP size ``case.cp`` and the tags agree on (None: no size at all); SpecError where they differ."""
    said = ({f"field 'case.cp' = {case_cp}": case_cp} if case_cp is not None else {}) | tags
    for where, cp in said.items():
        for other, other_cp in said.items():
            if other_cp != cp:
                raise SpecError(f"{path}: {where} and {other} disagree; expected one CP size")
    return next(iter(said.values()), None)


def save(path: str | Path, case: Case, signature: str | None = None) -> Path:
    """Write ``case`` (its non-default fields) and the signature it failed with, readable by hand. A file name
    or spec name whose ``-cp<N>`` tag is not the case's CP raises SpecError: load would reject the file."""
    _one_cp(Path(path), case.cp, _tags(Path(path), case.spec))
    data = case.spec.to_dict()
    data["case"] = {"cp": case.cp, **{k: getattr(case, k) for k, v in _DEFAULTS.items() if getattr(case, k) != v}}
    if signature is not None:
        data["expect"] = {"signature": signature}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n")
    return path


def name_with_cp(name: str, cp: int) -> str:
    """``name`` tagged with the CP size (replacing an existing tag): "step18412" -> "step18412-cp4"."""
    return f"{_CP_TAG.sub('', name) or 'microbatch'}-cp{cp}"


def cp_from_name(name: str) -> int | None:
    """The CP size a spec was captured or found at, from its name's trailing ``-cp<N>`` tag; None without one."""
    match = _CP_TAG.search(name)
    return int(match.group(1)) if match else None
