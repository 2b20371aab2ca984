"""zeroplan: will this ZeRO training run fit, where should each byte live, how fast will it go?

The planner behind the ``zero-plan`` command line, from Python. Every function returns the data
of zero-plan's JSON contract (``--format json``) as dicts and lists, computed by the same C++
code, and raises :class:`zeroplan.Error` with the CLI's message and hint for bad input.

    >>> import zeroplan
    >>> e = zeroplan.estimate("llama-2-7b", stage=3, dp=8, hardware="a100-80g")
    >>> e["per_device"]["gpu"]["total"], e["fits"]

``model`` is a catalog name (``zeroplan.models()`` lists them), a ``config.json`` path, the
directory ``save_pretrained`` wrote, or a dict (``transformers.PretrainedConfig.to_dict()``).

The strategy is given as keyword arguments named as zero-plan's flags (``--offload-optimizer
cpu`` is ``offload_optimizer="cpu"``, ``--flash-attention`` is ``flash_attention=True``), as a
dict of them (``strategy={"stage": 3, "dp": 8}``), or as a DeepSpeed config: a dict as
``ds_config.json`` holds it ("auto" values included) or the path of one. Keyword arguments
override the DeepSpeed config, as flags do on the command line. ``zero-plan estimate --help``
lists every flag; ``python3 -m zeroplan`` is zero-plan itself.
"""

import json as _json
import os as _os
import re as _re

from . import _zeroplan

__all__ = ["Error", "estimate", "plan", "fit", "table", "check", "models", "main"]


class Error(Exception):
    """Bad input or a failed operation: ``message`` names what (as zero-plan's ``error:`` line),
    ``hint`` says what to do (``hint:``; may be empty), ``field`` is the argument or config field
    at fault (``"dp"``, ``"zero_optimization.stage"``), or None where the message names none."""

    def __init__(self, message, hint=""):
        super().__init__(message, hint)
        self.message = message
        self.hint = hint or ""
        self.field = _field_of(message)

    def __str__(self):
        return self.message + (f"\nhint: {self.hint}" if self.hint else "")


_zeroplan._set_error_class(Error)

_FLAG = _re.compile(r"^--([a-z0-9][a-z0-9-]*)")
_CONFIG_FIELD = _re.compile(r"^[^:]+: (?:unknown |missing )?field '([^']+)'")
_UNKNOWN_VALUE = _re.compile(r"^[^:]+: unknown ([a-z_]+) '")
_NAMED = _re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*):")


def _field_of(message):
    """The argument a message of zero-plan's names: ``--dp: ...`` is ``dp``, ``strategy: field
    'zero_optimization.stage' ...`` is that field, ``model: unknown model_type 'x'`` is
    ``model_type``, ``micro_batch: ...`` is ``micro_batch``."""
    for pattern, flag in ((_FLAG, True), (_CONFIG_FIELD, False), (_UNKNOWN_VALUE, False),
                          (_NAMED, False)):
        m = pattern.match(message)
        if m:
            return m.group(1).replace("-", "_") if flag else m.group(1)
    return None


# Top-level keys that make a dict a DeepSpeed config rather than keyword arguments.
_DEEPSPEED_KEYS = {
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "fp16", "bf16", "gradient_clipping", "scheduler",
    "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "aio",
    "zero_allow_untested_optimizer", "communication_data_type", "prescale_gradients",
}


def _is_deepspeed_config(d):
    return any(k in _DEEPSPEED_KEYS or isinstance(v, dict) for k, v in d.items())


def _spell(name, value):
    """A keyword argument's value as zero-plan's flag spells it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(str(_spell(name, v)) for v in value)
    if isinstance(value, _os.PathLike):
        return _os.fspath(value)
    if isinstance(value, (str, int, float)):
        return str(value)
    raise Error(f"{name}: cannot use a {type(value).__name__} here",
                "give a number, a string, a list of them, or True/False for a switch")


def _dumps(name, obj):
    try:
        return _json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise Error(f"{name}: not JSON data ({e})", "give the dict json.load() returns") from None


def _run(command, function, kwargs, model=None, strategy=None, positional=()):
    model_json = ds_json = ""
    model_origin = "model"
    flags = {}
    if model is not None:
        if hasattr(model, "to_dict") and not isinstance(model, dict):  # a PretrainedConfig
            model = model.to_dict()
        if isinstance(model, dict):
            model_json = _dumps("model", model)
            # Its name in results: the hub id from_pretrained recorded, else "model".
            name = model.get("_name_or_path")
            model_origin = name if isinstance(name, str) and name else "model"
        elif isinstance(model, (str, _os.PathLike)):
            flags["model"] = _os.fspath(model)
        else:
            raise Error(f"model: cannot use a {type(model).__name__}",
                        "a catalog name, a config.json path, its directory, or a config dict")
    if strategy is not None:
        if isinstance(strategy, (str, _os.PathLike)):
            flags["ds_config"] = _os.fspath(strategy)
        elif isinstance(strategy, dict):
            if _is_deepspeed_config(strategy):
                ds_json = _dumps("strategy", strategy)
            else:
                flags.update(strategy)
        else:
            raise Error(f"strategy: cannot use a {type(strategy).__name__}",
                        "keyword arguments as a dict, a DeepSpeed config dict, or its path")
    flags.update(kwargs)
    pairs = [(k, _spell(k, v)) for k, v in flags.items() if v is not None]
    code, text = _zeroplan.run(command, function, list(positional), pairs, model_json, model_origin,
                                 ds_json)
    return code, _json.loads(text) if text else None


def estimate(model=None, strategy=None, hardware=None, profile=None, **kwargs):
    """Per-device memory of one model and strategy: ``zero-plan estimate --format json``
    (schema ``zero-plan/estimate/v1``). With ``hardware`` (a preset such as ``"a100-80g"`` or a
    hardware JSON path) the result says whether it ``fits``. Other keyword arguments are
    zero-plan's flags: ``stage``, ``dp``, ``micro_batch``, ``seq``, ``offload_optimizer``, ...,
    and ``report="r.html"``, ``timeline="t.json"``, ``output="e.json"`` write those files."""
    return _run("estimate", "estimate", dict(kwargs, hardware=hardware, profile=profile),
                model, strategy)[1]


def plan(model=None, strategy=None, profile=None, output=None, seed=None, **kwargs):
    """The plan zero-run executes (schema ``zero-plan/plan/v1``), written to ``output`` when given
    (atomically, as ``zero-plan plan -o``) and returned either way."""
    return _run("plan", "plan", dict(kwargs, profile=profile, output=output, seed=seed),
                model, strategy)[1]


def fit(model=None, hardware=None, gpus=1, strategy=None, profile=None, **kwargs):
    """The fastest configurations that fit ``gpus`` GPUs of ``hardware``, best first (schema
    ``zero-plan/fit/v1``; an empty ``candidates`` list and the closest miss when nothing fits).
    ``max_model=True`` adds the largest model of the family that fits; ``parallel=True``
    searches tensor, pipeline and context parallelism; strategy keywords pin a dimension."""
    return _run("fit", "fit", dict(kwargs, hardware=hardware, gpus=gpus, profile=profile),
                model, strategy)[1]


def table(params=(7.5e9, 128e9, 1e12), dp=(1, 4, 16, 64, 256, 1024), k=12):
    """The ZeRO paper's model-state table (its Table 1, plus stage 0): bytes per device for
    every model size, data-parallel degree and stage (schema ``zero-plan/table/v1``)."""
    return _run("table", "table", {"params": params, "dp": dp, "k": k})[1]


def check(budgets, junit=None, update=False):
    """Holds each case of a budgets file (schema ``zero-plan/budgets/v1``) against its limits, as
    ``zero-plan check``; ``passed`` in the result says whether every case did."""
    return _run("check", "check", {"junit": junit, "update": update or None},
                positional=[_os.fspath(budgets)])[1]


def models(model=None):
    """The model catalog, or with ``model`` (a name or a config.json) its parameter inventory."""
    if isinstance(model, dict):
        raise Error("model: models() takes a name or a path", "estimate() takes a config dict")
    return _run("models", "models", {}, positional=[] if model is None else [_os.fspath(model)])[1]


def main(argv=None):
    """zero-plan's command line in this process: ``python3 -m zeroplan estimate --model ...``."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    return _zeroplan.main(["zero-plan"] + list(sys.argv[1:] if argv is None else argv))
