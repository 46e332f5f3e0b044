"""A plan's file format: its version and fields, the writer (``plan_data``, then ``dump_plan`` as YAML or JSON by the
file's suffix) and the reader (``parse_plan``, then ``plan_fields``), which refuses anything ``save`` could not have
written with a ``ValueError`` naming the file, the field, the value and the fix. ``PrecisionPlan.to_dict``,
``from_dict``, ``save`` and ``load`` call them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from lightning_precision._io import json_safe
from lightning_precision.fp8._plan_types import (
    KIND,
    FormatOption,
    LayerPlan,
    PlanRule,
    check_bound,
    check_count,
    check_layer,
    check_recipe,
    check_unique,
    shown,
)

__all__ = ["PLAN_VERSION", "dump_plan", "parse_plan", "plan_data", "plan_fields", "plan_suffix"]

PLAN_VERSION = 1
# A plan's fields in a file; `recipe`: the name of `scaling_family` in the plans written before it (they keep loading).
_PLAN_KEYS = ("version", "scaling_family", "recipe", "batches", "rule", "device", "device_here", "benchmarked",
              "baseline", "layers")
# What a plan that chose among formats adds: what its savings are for.
_DEVICE_KEYS = ("device", "device_here", "benchmarked", "baseline")
_LAYER_KEYS = ("fqn", "precision", "reason", "numbers", "predicted_saving", "alternatives")
_OPTION_KEYS = tuple(f.name for f in dataclasses.fields(FormatOption))


# ---- the writer -------------------------------------------------------------------------------------------------


def plan_data(layers: Sequence[LayerPlan], scaling_family: str, rule: PlanRule, batches: int, device: str = "",
              device_here: bool = False, benchmarked: bool = False, baseline: float = 0.0) -> dict[str, Any]:
    """A plan's fields as plain data (``PrecisionPlan.to_dict``): infinities and NaN as the strings ``"inf"``,
    ``"-inf"``, ``"nan"``, since strict JSON has none."""
    data: dict[str, Any] = {
        "version": PLAN_VERSION, "scaling_family": scaling_family, "batches": batches,
        "rule": json_safe(dataclasses.asdict(rule)),
    }
    if device:  # a plan that chose among formats: what its savings are for
        data.update(device=device, device_here=device_here, benchmarked=benchmarked, baseline=baseline)
    data["layers"] = [_layer_data(p) for p in layers]
    return data


def _layer_data(p: LayerPlan) -> dict[str, Any]:
    entry: dict[str, Any] = {"fqn": p.fqn, "precision": p.precision, "reason": p.reason,
                             "numbers": json_safe(p.numbers)}
    if p.alternatives:
        entry["predicted_saving"] = p.predicted_saving
        entry["alternatives"] = [json_safe(dataclasses.asdict(a)) for a in p.alternatives]
    return entry


def plan_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"PrecisionPlan: {str(path)!r}: name a .yaml, .yml or .json file.")
    return suffix


def dump_plan(data: dict[str, Any], path: Path) -> str:
    if plan_suffix(path) == ".json":
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    import yaml

    # libyaml's emitter where PyYAML has it (several times faster on a large model's plan), the same output otherwise
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, width=120)


# ---- the reader -------------------------------------------------------------------------------------------------


def plan_fields(data: Any, where: str) -> dict[str, Any]:
    """``PrecisionPlan``'s fields from the data ``plan_data`` gave (read from a file or a checkpoint); each error
    names ``where`` the data came from, the field, the value and the fix."""
    if not isinstance(data, Mapping):
        found = "nothing (it is empty)" if data is None else KIND.get(type(data), type(data).__name__)
        raise ValueError(f"{where}: a plan is a mapping with `version` and `layers`, not {found}; write it with"
                         " `PrecisionPlan.save`, or see docs/plan.md.")
    version = data.get("version")
    if "version" not in data:
        raise ValueError(f"{where}: `version` is missing; add `version: {PLAN_VERSION}`.")
    if not isinstance(version, int) or isinstance(version, bool) or version != PLAN_VERSION:
        raise ValueError(f"{where}: version {shown(version)} is not {PLAN_VERSION}, the one this package reads;"
                         f" write `version: {PLAN_VERSION}`, or read the file with the lightning-precision that"
                         " wrote it.")
    # after the version: a later format may add fields, and its plans should be refused for their version
    _check_keys(where, "the plan", data, _PLAN_KEYS)
    if "scaling_family" in data and "recipe" in data:
        raise ValueError(f"{where}: both `scaling_family` and `recipe` (its older name) are given; keep"
                         " `scaling_family`.")
    key = "recipe" if "recipe" in data else "scaling_family"
    scaling_family, batches = data.get(key, "tensorwise"), data.get("batches", 0)
    check_recipe(f"{where}: `{key}`", scaling_family)
    check_count(f"{where}: `batches`", batches)
    rule = _rule(where, data.get("rule", {}))
    extra = {k: data[k] for k in _DEVICE_KEYS if k in data}
    if "baseline" in extra:
        extra["baseline"] = _number(extra["baseline"])
    return {"layers": _layers(where, data), "scaling_family": scaling_family, "rule": rule, "batches": batches,
            **extra}


def _rule(where: str, rule: Any) -> PlanRule:
    if not isinstance(rule, Mapping):
        raise ValueError(f"{where}: `rule` is {shown(rule)}; a mapping of PlanRule's bounds (e.g."
                         " `max_underflow: 0.001`), or leave it out for the defaults.")
    _check_keys(where, "`rule`", rule, [f.name for f in dataclasses.fields(PlanRule)])
    bounds = {k: _number(v) for k, v in rule.items()}
    for f in dataclasses.fields(PlanRule):
        if f.name in bounds:
            check_bound(f"{where}: `rule.{f.name}`", bounds[f.name], cast(float, f.default))
    return PlanRule(**bounds)


def _layers(where: str, data: Mapping[str, Any]) -> tuple[LayerPlan, ...]:
    if "layers" not in data:
        raise ValueError(f"{where}: `layers` is missing; list each linear layer with its `fqn` and `precision`.")
    entries = data["layers"]
    if not isinstance(entries, list):
        raise ValueError(f"{where}: `layers` is {shown(entries)}; a list of layers, each with `fqn` and"
                         " `precision` (`layers: []` for none).")
    layers = tuple(_layer(where, i, entry) for i, entry in enumerate(entries))
    check_unique(where, (p.fqn for p in layers))
    return layers


def _layer(where: str, i: int, entry: Any) -> LayerPlan:
    """The file's ``layers[i]``."""
    d = _check_entry(entry, f"{where}: `layers[{i}]`", (where, f"`layers[{i}]`"), _LAYER_KEYS, ("fqn", "precision"),
                     "{at} is {value}; each layer is a mapping with `fqn` and `precision`.",
                     "{at} has no `{field}`; each layer needs `fqn` and `precision` (fp8, or the high precision it"
                     " runs in: high, bf16, fp16 or fp32).")
    # `reason:` or `numbers:` with nothing after it is YAML's null
    reason = "" if d.get("reason") is None else d["reason"]
    numbers = {} if d.get("numbers") is None else d["numbers"]
    numbers = {k: _number(v) for k, v in numbers.items()} if isinstance(numbers, Mapping) else numbers
    check_layer(functools.partial(_field_of_entry, where, i), d["fqn"], d["precision"], reason, numbers)
    alternatives = _alternatives(f"{where}: `layers[{i}].alternatives`", d.get("alternatives"))
    saving = _number(d.get("predicted_saving", 0.0))
    try:
        return LayerPlan(d["fqn"], d["precision"], reason, numbers, alternatives, saving)
    except ValueError as err:
        raise ValueError(f"{where}: `layers[{i}]`: {err}") from None


def _field_of_entry(where: str, i: int, name: str) -> str:
    """How an error names a field of a file's ``layers[i]``."""
    return f"{where}: `layers[{i}].{name}`"


def _alternatives(where: str, value: Any) -> tuple[FormatOption, ...]:
    """A file's ``alternatives`` list: each a mapping of FormatOption's fields (inf as the string "inf")."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{where}: {shown(value)} is not a list of formats weighed (each with format, error,"
                         " predicted_saving, verdict); leave it out if there are none.")
    out = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        d = _check_entry(entry, at, (where, f"entry {i}"), _OPTION_KEYS, _OPTION_KEYS,
                         "{at}: {value} is not a mapping with format, error, predicted_saving, verdict.",
                         f"{{at}} has no `{{field}}`; each entry has {', '.join(_OPTION_KEYS)}.")
        try:
            out.append(FormatOption(d["format"], _number(d["error"]), _number(d["predicted_saving"]), d["verdict"]))
        except ValueError as err:
            raise ValueError(f"{at}: {err}") from None
    return tuple(out)


def _check_entry(entry: Any, at: str, unknown: tuple[str, str], known: Sequence[str], required: Sequence[str],
                 not_a_mapping: str, missing: str) -> Mapping[str, Any]:
    """One mapping of a file's list (a layer, or a format a layer weighed), named ``at``: a ``ValueError`` where it is
    not a mapping (``not_a_mapping``, its ``{at}`` and ``{value}`` filled in), has a field not ``known`` (named as
    ``unknown``: where and what) or lacks a ``required`` one (``missing``, its ``{at}`` and ``{field}`` filled in)."""
    if not isinstance(entry, Mapping):
        raise ValueError(not_a_mapping.format(at=at, value=shown(entry)))
    _check_keys(*unknown, entry, known)
    absent = [k for k in required if k not in entry]
    if absent:
        raise ValueError(missing.format(at=at, field=absent[0]))
    return entry


def _check_keys(where: str, what: str, data: Mapping[Any, Any], known: Iterable[str]) -> None:
    """A misspelt field would otherwise be ignored, and its default used in silence."""
    known = tuple(known)
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ValueError(f"{where}: {what} has an unknown field {unknown[0]!r}; the fields are {', '.join(known)}.")


def _number(value: Any) -> Any:
    """A number as a file holds it: ``save`` writes inf and NaN as strings, and YAML reads ``1e-3`` (no dot) as a
    string. Anything else is returned as it is, for the check to name."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_plan(text: str, path: Path, source: str | None = None) -> Any:
    """The data in ``text`` (JSON or YAML by ``path``'s suffix). A syntax error, a repeated key (which either parser
    would resolve by keeping the last, silently) or a YAML tag is a ``ValueError`` naming ``source`` and the line."""
    where: str = source or f"plan file {str(path)!r}"
    if plan_suffix(path) == ".json":
        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            _check_no_repeats(where, [k for k, _ in items], None)
            return dict(items)

        try:
            return json.loads(text, object_pairs_hook=pairs)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}; fix it,"
                             " or write the plan again with `PrecisionPlan.save`.") from None
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]  # safe: a tag such as !!python/object is refused
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):  # merge keys (<<) may repeat a key on purpose: not checked
                keys = [(self.construct_object(k, deep=True), k.start_mark.line + 1) for k, _ in node.value
                        if k.tag != "tag:yaml.org,2002:merge"]
                _check_no_repeats(where, [k for k, _ in keys], [line for _, line in keys])
            return super().construct_mapping(node, deep=deep)

    loader = Loader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ValueError(f"{where}: not a plan YAML can read: {problem}{at}; fix it (plain YAML, no tags), or write"
                         " the plan again with `PrecisionPlan.save`.") from None
    finally:
        loader.dispose()


def _check_no_repeats(source: str, keys: list[Any], lines: list[int] | None) -> None:
    seen: set[Any] = set()
    for i, key in enumerate(keys):
        try:
            repeated = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: the mapping check names it
            continue
        if repeated:
            at = f" (line {lines[i]})" if lines else ""
            raise ValueError(f"{source}: the key {key!r} appears twice in one mapping{at}; keep one.")
