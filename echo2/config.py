"""Structured configs: the schema every YAML under ``conf/`` is checked against, and the one validation function.

Registered in Hydra's ConfigStore, so a typo (``rollout.stalenes=4``, ``broadcast.sender.fanuot=3``) or a wrong type
fails when the config is composed, before anything starts. Each knob's meaning and units are documented in its
YAML file. The schemas of the components Hydra instantiates (``rollout.source``, ``broadcast.sender``) are read
from their constructors (``schema_of``): each default is written once, in the constructor.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING

from echo2.activation.settings import ActivationSettings
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.learner.sources.async_source import AsyncRolloutSource
from echo2.learner.sources.lagged import LaggedRolloutSource
from echo2.learner.sources.sync import SyncRolloutSource
from echo2.tasks.arith import ArithTask
from echo2.tasks.arith_chat import ArithChatTask
from echo2.tasks.calculator import CalculatorTask
from echo2.tasks.dataset import DatasetTask
from echo2.tasks.gsm8k import Gsm8kTask
from echo2.tasks.kuhn import KuhnTask
from echo2.tasks.poker import PokerTask


def schema_of(cls: type, *, target: bool = True, skip: tuple[str, ...] = (), required: bool = False,
              extra: tuple = ()) -> type:
    """A structured config of ``cls``'s options, read from its constructor (or, for a dataclass, its fields): each
    keyword parameter with a default becomes a field of that name, type and default, and one whose type is a
    dataclass becomes a nested schema. ``_target_`` names ``cls`` (``target``); ``skip``: parameters no config
    sets (objects wired from code); ``required``: parameters without a default become mandatory fields (``???``),
    as a task's are; ``extra``: more fields, ``(name, type, field)``. A parameter without a type hint is ``Any``."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        params = [(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
                  for f in dataclasses.fields(cls)]
    else:
        hints, params, names = {}, [], set()
        for base in cls.__mro__:  # a constructor taking **kwargs hands them on (super().__init__(**kwargs)): its
            if base is object or "__init__" not in vars(base):  # parent's parameters are options too
                continue
            hints = {**typing.get_type_hints(base.__init__), **hints}
            signature = inspect.signature(base.__init__).parameters.values()
            params += [(p.name, MISSING if p.default is inspect.Parameter.empty else p.default) for p in signature
                       if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
                       and p.name not in names and (p.default is not inspect.Parameter.empty or required)]
            names |= {name for name, _ in params}
            if not any(p.kind is p.VAR_KEYWORD for p in signature):
                break
    out: list = [("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}"))] if target else []
    out += list(extra)
    for name, default in params:
        if name in skip:
            continue
        kind = _config_type(hints.get(name, Any))
        if dataclasses.is_dataclass(kind):
            out.append((name, kind, field(default_factory=kind)))
        elif isinstance(default, (list, dict)):
            out.append((name, kind, field(default_factory=lambda d=default: type(d)(d))))
        else:
            out.append((name, kind, field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", out)


def _config_type(hint: Any) -> Any:
    """The nearest type OmegaConf can check: ``X | None`` is Optional[X], ``list[X]`` List[X], a dataclass its schema;
    anything else (a union, an object) Any."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        inner = _config_type(rest[0]) if len(rest) == 1 else Any
        return Optional[inner] if len(rest) < len(args) else inner
    if typing.get_origin(hint) is list:
        return List[_config_type(args[0]) if args else Any]
    if typing.get_origin(hint) is dict or hint is dict:
        return Dict[str, Any]
    if hint in (int, float, str, bool):
        return hint
    if dataclasses.is_dataclass(hint):
        return schema_of(hint, target=False)
    return Any


# The built-in tasks' schemas, read from their constructors like the components'. ``task=dataset`` is instantiated
# without recursion (``_recursive_``): its reward functions given as Hydra nodes are built by the task itself, where
# they run (the coordinator's reward processes), not pickled across from the learner.
ArithTaskConfig = schema_of(ArithTask, required=True)
KuhnTaskConfig = schema_of(KuhnTask, required=True)
Gsm8kTaskConfig = schema_of(Gsm8kTask, required=True)
ArithChatTaskConfig = schema_of(ArithChatTask, required=True)
DatasetTaskConfig = schema_of(DatasetTask, required=True, extra=(("_recursive_", bool, field(default=False)),))
CalculatorTaskConfig = schema_of(CalculatorTask, required=True)
PokerTaskConfig = schema_of(PokerTask, required=True)
TASK_SCHEMAS = {"arith_schema": ArithTaskConfig, "kuhn_schema": KuhnTaskConfig, "gsm8k_schema": Gsm8kTaskConfig,
                "arith_chat_schema": ArithChatTaskConfig, "dataset_schema": DatasetTaskConfig,
                "calculator_schema": CalculatorTaskConfig, "poker_schema": PokerTaskConfig}

AsyncSourceConfig = schema_of(AsyncRolloutSource)
SyncSourceConfig = schema_of(SyncRolloutSource)
LaggedSourceConfig = schema_of(LaggedRolloutSource)
RelayBroadcasterConfig = schema_of(RelayBroadcaster, skip=("link", "state_dir"))  # link: the lab's link emulation;
# state_dir: the run directory, wired by the coordinator process
SOURCE_SCHEMAS = {"async_schema": AsyncSourceConfig, "sync_schema": SyncSourceConfig,
                  "lagged_schema": LaggedSourceConfig}
SENDER_SCHEMAS = {"relay_schema": RelayBroadcasterConfig}


@dataclass
class ModelConfig:
    name: str = MISSING
    path: Any = MISSING  # a node with _target_ returning something from_pretrained accepts
    dtype: str = "float32"  # or auto (learner/args.resolve_precision)


@dataclass
class LoraSettings:
    rank: Optional[int] = None  # null: full fine-tuning
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # or a list of module names
    use_rslora: bool = False


@dataclass
class LearnerConfig:
    learning_rate: float = 3e-3
    lr_scheduler_type: str = "constant"
    warmup_steps: float = 0.0
    lr_staleness: str = "none"
    lr_ref_lag: float = 1.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    bf16: Optional[bool] = None  # null: follow model.dtype (learner/args.resolve_precision)
    low_precision_weights: bool = False
    micro_batch_size: Optional[int] = None
    gradient_checkpointing: bool = False
    num_iterations: int = 1
    deepspeed: Optional[Any] = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    trl: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    source: Any = MISSING
    engine: Any = MISSING
    staleness: int = 0
    group_size: int = 8
    prompts_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    correction: str = "none"  # echo2/learner/corrections.py: CORRECTIONS
    is_min: float = 0.5
    is_max: float = 2.0
    icepop_min: float = 0.5
    icepop_max: float = 5.0
    m2_threshold: float = 0.04
    seq_min: float = 0.5
    seq_max: float = 2.0
    max_log_ratio: float = 5.0


@dataclass
class BroadcastConfig:
    interval: int = 1
    sender: Any = MISSING


# The activation group's schema is the online planner's own typed settings (one definition of each key).
ActivationConfig = ActivationSettings


@dataclass
class RunConfig:
    steps: int = 200
    eval_every_steps: int = 50
    eval_on: str = "learner"
    wandb: str = "offline"
    project: str = "echo2"
    group: Optional[str] = None
    name: Optional[str] = None
    progress: bool = True
    save_every_steps: int = 50
    keep_checkpoints: int = 2
    resume: str = "auto"
    report_to: Any = field(default_factory=lambda: ["wandb"])  # a name, a list of names, "all" or "none"
    tags: List[str] = field(default_factory=list)
    completions_every_steps: int = 10
    completions_rows: int = 16
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_private: Optional[bool] = None


@dataclass
class Config:
    seed: int = 0
    model: ModelConfig = MISSING
    task: Any = MISSING
    learner: LearnerConfig = MISSING
    rollout: RolloutConfig = MISSING
    broadcast: BroadcastConfig = MISSING
    activation: ActivationConfig = MISSING
    pool: Any = MISSING
    run: RunConfig = field(default_factory=RunConfig)


def register_configs() -> None:
    """The structured configs, at the top of the config store: each group's YAML names its schema in its defaults
    (``- /rollout_schema@_here_``, ``- /async_schema@source``), so the schemas check every option without being
    options of a group themselves (Hydra's option lists and ``--help`` show only the YAML files)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name, node in {"model_schema": ModelConfig, **TASK_SCHEMAS,
                       "learner_schema": LearnerConfig, "rollout_schema": RolloutConfig,
                       "broadcast_schema": BroadcastConfig, "activation_schema": ActivationConfig,
                       **SOURCE_SCHEMAS, **SENDER_SCHEMAS}.items():
        cs.store(name=name, node=node)


WANDB_MODES = ("offline", "online", "disabled")


def unknown_key(dotted: str, task_schema: type | None = None) -> str | None:
    """Why ``dotted`` (an override's key, e.g. ``rollout.stalenes``) is not an option, or None if it may be one.
    Walks the structured configs; below a field typed ``Any`` or ``dict`` (``pool``, ``learner.trl``,
    ``learner.deepspeed``) anything goes. ``task`` keys are checked against ``task_schema`` (the schema of a task of
    your own, read from its constructor: ``own_task_schema``), else against every built-in task's schema;
    ``rollout.source`` against every source's and ``broadcast.sender`` against the broadcaster's; a key added with
    ``+`` below these two may be an option of a component of your own (named by ``_target_``): validate() judges it
    once composed."""
    parts = dotted.lstrip("+~").split(".")
    if parts[0] == "hydra" or "/" in parts[0]:
        return None
    nodes: tuple = (Config,)
    for depth, key in enumerate(parts):
        fields: dict[str, Any] = {}
        for node in nodes:
            fields.update(typing.get_type_hints(node))
        if key not in fields:
            if depth == 0 and key in GROUPS_WITHOUT_SCHEMA:
                return None
            where = ".".join(parts[:depth]) or "the top level"
            near = difflib.get_close_matches(key, [f for f in fields if not f.startswith("_")], n=1)
            hint = f" (did you mean {'.'.join(parts[:depth] + near)}?)" if near else ""
            if depth == len(parts) - 1 and (trl := trl_hint(key)):  # a TRL name: where echo2 keeps that setting
                hint = f" ({trl})"
            return (f"{dotted.lstrip('+~')}: no such option in {where}{hint}; every option is listed in "
                    "docs/config.md")
        hint = fields[key]
        if typing.get_origin(hint) is typing.Union:  # Optional[X]
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if depth == 0 and key == "task":
            nodes = (task_schema,) if task_schema is not None else tuple(TASK_SCHEMAS.values())
        elif tuple(parts[:depth + 1]) in COMPONENT_SCHEMAS:
            if dotted.startswith("+"):
                return None
            nodes = COMPONENT_SCHEMAS[tuple(parts[:depth + 1])]
        elif dataclasses.is_dataclass(hint):
            nodes = (hint,)
        elif tuple(parts[:depth + 1]) == ("learner", "trl") and depth + 1 < len(parts):
            return trl_errors(parts[depth + 1])  # the GRPOConfig pass-through: TRL's own field names
        else:
            return None  # a value (or a free-form node): Hydra and the component check it
    return None


def trl_hint(name: str) -> str | None:
    """Where echo2 keeps the setting TRL's GRPOConfig calls ``name`` (None: not a GRPOConfig field). Reads TRL only
    for names that could be one (a plain identifier)."""
    if not name.isidentifier():
        return None
    from echo2.learner.trl_fields import hint

    return hint(name)


def trl_errors(name: str) -> str | None:
    """Why ``learner.trl.<name>`` cannot be set (owned by echo2, refused, or no GRPOConfig field), or None."""
    from echo2.learner.trl_fields import check

    errors = check({name: None})
    return errors[0] + "; every option is listed in docs/config.md" if errors else None


GROUPS_WITHOUT_SCHEMA = ("experiment",)
BUILTIN_TASKS = {getattr(kind, "_target_") for kind in TASK_SCHEMAS.values()}
COMPONENT_SCHEMAS = {("rollout", "source"): tuple(SOURCE_SCHEMAS.values()),
                     ("broadcast", "sender"): tuple(SENDER_SCHEMAS.values())}


def check_overrides(argv: list[str]) -> list[str]:
    """The errors of command-line overrides that name no option, ``+key=value`` included (Hydra would add such
    a key to a structured config silently). Run before Hydra composes, so that ``--cfg job`` fails too."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:
        return []  # not ours to judge: Hydra reports malformed overrides itself
    task_schema = own_task_schema(overrides)
    added = lambda o: "+" if o.is_add() or o.is_force_add() else ""  # noqa: E731 (a key added with + or ++)
    return [why for o in overrides
            if not o.is_delete() and (why := unknown_key(added(o) + o.key_or_group, task_schema))]


def config_dirs(overrides: list, conf_dir: Path) -> list[Path]:
    """Where Hydra looks for a group's option files: ``conf_dir``, then each ``hydra.searchpath=[file://DIR]`` folder
    the parsed command line adds (the last such override wins, as in Hydra)."""
    searchpath: list[str] = []
    for o in overrides:
        if o.key_or_group == "hydra.searchpath" and not o.is_delete() and isinstance(o.value(), list):
            searchpath = [str(p) for p in o.value()]
    return [Path(conf_dir)] + [Path(p[len("file://"):]) for p in searchpath if p.startswith("file://")]


def own_task_schema(overrides: list, conf_dir: Path | None = None) -> type | None:
    """The schema (read from its constructor) of a task of your own that the command line selects: ``task._target_=
    pkg.Task``, or ``task=NAME`` whose ``task/NAME.yaml`` (in conf/ or a ``hydra.searchpath=[file://DIR]`` folder)
    names a class that is not a built-in task. None for a built-in task, or where it cannot be told before Hydra
    composes (then validate() judges the composed node)."""
    from omegaconf import OmegaConf

    target = name = None
    for o in overrides:
        if o.is_delete() or o.is_sweep_override():
            continue
        if o.key_or_group == "task._target_":
            target = str(o.value())
        elif o.key_or_group == "task":
            name = str(o.value())
    if target is None and name is not None:
        for d in config_dirs(overrides, conf_dir or CONF_DIR):
            path = Path(d) / "task" / f"{name}.yaml"
            if path.is_file():
                node = OmegaConf.load(path)
                target = node.get("_target_") if isinstance(node, dict) or hasattr(node, "get") else None
                break
    if target is None or target in BUILTIN_TASKS:
        return None
    try:
        return schema_of(get_class(target), required=True)
    except Exception:  # not importable here: validate() says why, once composed
        return None


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def check_experiments(argv: list[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """The errors of keys that name no option in the experiment files the command line selects (``experiment=x``,
    or ``experiment=x,y`` in a sweep), each with "did you mean" where a near option exists; the keys of their
    ``hydra.sweeper.params`` are judged as overrides. Hydra refuses such a key too, when it merges the file, but
    names only the key. The file is looked for in ``conf_dir/experiment``, then in each search-path folder's
    (config_dirs); one found in none, or not ``@package _global_``, is left to Hydra, and so is a source or
    broadcaster of your own (a ``_target_`` that is not the registered class)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    candidates = [a for a in argv if a.lstrip("+").startswith(("experiment=", "hydra.searchpath="))]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:
        return []  # Hydra reports malformed overrides itself
    names = [n for o in overrides if o.key_or_group == "experiment"
             for n in (o.sweep_string_iterator() if o.is_sweep_override() else [o.value()]) if isinstance(n, str)]
    dirs = config_dirs(overrides, conf_dir)
    own = {path: {getattr(kind, "_target_", None) for kind in kinds} for path, kinds in COMPONENT_SCHEMAS.items()}
    errors: list[str] = []
    for name in dict.fromkeys(names):
        path = next((p for d in dirs if (p := d / "experiment" / f"{name}.yaml").is_file()), None)
        if path is None or "@package _global_" not in path.read_text().split("\n", 1)[0]:
            continue
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        where = f"{path.parent.name}/{path.name}"
        params = ((tree.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
        errors += [f"{where}: {why}" for key in params if (why := unknown_key(str(key)))]

        def walk(node: dict, parts: tuple[str, ...]) -> None:
            target = node.get("_target_")
            if parts in own and target is not None and target not in own[parts]:
                return  # a component of your own: its constructor judges its options
            for key, value in node.items():
                dotted = ".".join((*parts, str(key)))
                if why := unknown_key(dotted):
                    errors.append(f"{where}: {why}")
                elif isinstance(value, dict):
                    walk(value, (*parts, str(key)))

        walk({k: v for k, v in tree.items() if k not in ("defaults", "hydra")}, ())
    return errors


def unknown_keys(cfg: Any) -> list[str]:
    """Keys of a composed config that its structured configs do not declare (e.g. added with ``+``). A component
    whose ``_target_`` is not its schema's (a source or broadcaster of your own) is not judged: its constructor is."""
    from omegaconf import DictConfig, OmegaConf

    out = []

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, DictConfig):
            return
        kind = OmegaConf.get_type(node)
        target = getattr(kind, "_target_", None)  # a schema_of() schema names its class
        if target is not None and node.get("_target_") != target:
            return
        for key in node.keys():
            dotted = f"{prefix}{key}"
            if dataclasses.is_dataclass(kind) and key not in {f.name for f in dataclasses.fields(kind)}:
                out.append(unknown_key(dotted) or f"{dotted}: no such option")
            else:
                walk(node._get_node(key), dotted + ".")

    walk(cfg, "")
    return out


def task_errors(node: Any) -> list[str]:
    """The errors of a task of your own (a ``_target_`` that is not a built-in task's): its options are checked
    against its constructor's parameters (names, types, and those without a default set), as a built-in task's are
    against its schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    target = node.get("_target_")
    if target is None or getattr(OmegaConf.get_type(node), "_target_", None) == target:
        return []  # a built-in task: its schema judged it (unknown_keys)
    try:
        schema = schema_of(get_class(target), required=True)
    except Exception as e:
        return [f"task._target_={target}: cannot import it ({type(e).__name__}: {e})"]
    names = {f.name for f in dataclasses.fields(schema)}
    errors = []
    for key in node:
        if not str(key).startswith("_") and key not in names:
            near = difflib.get_close_matches(str(key), sorted(names - {"_target_"}), n=1)
            errors.append(f"task.{key}: no such option of {target} (its options: {', '.join(sorted(names - {'_target_'}))}"
                          f"){f'; did you mean task.{near[0]}?' if near else ''}")
    if errors:
        return errors
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema),
                                 {k: v for k, v in node.items_ex(resolve=False) if not str(k).startswith("_")})
    except OmegaConfBaseException as e:
        return [f"task ({target}): {str(e).splitlines()[0]}"]
    return [f"task.{k}: {target} needs it (no default)" for k in names if OmegaConf.is_missing(merged, k)]


class ConfigError(ValueError):
    """A setting that composes but cannot run; train.py logs it (the run's train.log) and exits 1, no traceback."""


def validate(cfg: Any, world_size: int = 1) -> None:
    """Fail fast, with the key to change, on settings that compose but cannot run."""
    r = cfg.rollout
    errors = unknown_keys(cfg) + task_errors(cfg.task)
    if r.group_size < 2:
        errors.append(f"rollout.group_size={r.group_size}: GRPO needs at least 2 completions per prompt")
    if r.prompts_per_step < 1 or r.prompts_per_step % world_size:
        errors.append(f"rollout.prompts_per_step={r.prompts_per_step} must be a positive multiple of the "
                      f"{world_size} learner processes (each process takes whole groups)")
    if r.staleness < 0:
        errors.append(f"rollout.staleness={r.staleness}: must be >= 0")
    source = get_class(r.source._target_)
    remote = not source.needs_policy  # a source the learner does not lend its policy to generates elsewhere
    if source.max_staleness is not None and r.staleness > source.max_staleness:
        errors.append(f"rollout.staleness={r.staleness}: {source.__name__} supports S <= {source.max_staleness}; "
                      "use rollout=async (remote workers) or rollout=lagged (in-process, lag exactly S) for S > 0")
    if remote and world_size > 1 and r.source.get("check_every_steps", 0):
        errors.append("rollout.source.check_every_steps > 0 with a multi-process learner is not supported yet (the "
                      "check's forward would run on rank 0 alone); set it to 0 or use one learner process")
    if source.single_process and world_size > 1:
        errors.append(f"rollout.source: {source.__name__} runs with one learner process only (it keeps whole copies "
                      f"of the weights); launched with {world_size}")
    if remote and not 1 <= cfg.broadcast.interval <= r.staleness + 1:
        errors.append(f"broadcast.interval={cfg.broadcast.interval} with rollout.staleness={r.staleness}: need "
                      "1 <= interval <= S+1, else workers hold weights too old for any dispatch and the learner "
                      "waits forever")
    if cfg.learner.lr_staleness not in ("none", "inverse") or cfg.learner.lr_ref_lag < 0:
        errors.append(f"learner.lr_staleness={cfg.learner.lr_staleness!r}, lr_ref_lag={cfg.learner.lr_ref_lag}: "
                      "expected none or inverse, and lr_ref_lag >= 0")
    if cfg.learner.lr_staleness != "none" and cfg.learner.deepspeed:
        errors.append("learner.lr_staleness=inverse with DeepSpeed: its engine steps the optimizer inside backward, "
                      "before the rate can be scaled; use the single-process learner (learner=default)")
    from echo2.learner.corrections import CORRECTIONS, SCALE_REWARDS  # the definitions' module (it imports torch)

    if r.correction not in CORRECTIONS:
        errors.append(f"rollout.correction={r.correction!r}: expected one of {', '.join(CORRECTIONS)}")
    for lo, hi in (("is_min", "is_max"), ("icepop_min", "icepop_max"), ("seq_min", "seq_max")):
        if not 0 <= r[lo] <= 1 <= r[hi]:  # a ratio of 1 (on-policy) must always be kept
            errors.append(f"rollout.{lo}={r[lo]}, {hi}={r[hi]}: need 0 <= {lo} <= 1 <= {hi}")
    if not r.max_log_ratio > 0:
        errors.append(f"rollout.max_log_ratio={r.max_log_ratio}: must be > 0 (nats)")
    if r.m2_threshold <= 0:
        errors.append(f"rollout.m2_threshold={r.m2_threshold}: must be > 0 (nats², the batch's mean (log w)²)")
    if r.temperature <= 0:
        errors.append(f"rollout.temperature={r.temperature}: must be > 0")
    if r.top_p != 1 or r.top_k != 0:
        errors.append(f"rollout.top_p={r.top_p}, top_k={r.top_k}: truncated sampling is not supported. The engines "
                      "report logprobs of the truncated, renormalised distribution, while the learner scores the full "
                      "softmax at the temperature, so every importance ratio would be biased. Keep top_p=1, top_k=0 "
                      "and lower rollout.temperature to sharpen sampling.")
    if (cfg.task.get("max_completion_length") or 1) < 1:  # a task of your own may set it in code instead
        errors.append(f"task.max_completion_length={cfg.task.max_completion_length}: must be >= 1")
    if cfg.run.steps < 1:
        errors.append(f"run.steps={cfg.run.steps}: must be >= 1")
    if cfg.run.save_every_steps < 0 or cfg.run.keep_checkpoints < 1:
        errors.append(f"run.save_every_steps={cfg.run.save_every_steps}, keep_checkpoints={cfg.run.keep_checkpoints}: "
                      "need save_every_steps >= 0 (0: never) and keep_checkpoints >= 1")
    if cfg.run.wandb not in WANDB_MODES:
        errors.append(f"run.wandb={cfg.run.wandb!r}: expected one of {WANDB_MODES}")
    a = cfg.activation
    if a.solver not in ("all_on", "greedy", "exact"):
        errors.append(f"activation.solver={a.solver!r}: expected all_on, greedy or exact")
    if not 0 <= a.min_utilization <= 1 or a.hysteresis < 0 or a.learner_usd_per_hour < 0:
        errors.append("activation: need 0 <= min_utilization <= 1, hysteresis >= 0, learner_usd_per_hour >= 0")
    lora = cfg.learner.lora
    if lora.rank is not None and (lora.rank < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1):
        errors.append(f"learner.lora: rank={lora.rank}, alpha={lora.alpha}, dropout={lora.dropout}: need rank >= 1 "
                      "(null: full fine-tuning), alpha > 0 and 0 <= dropout < 1")
    if cfg.learner.scale_rewards not in SCALE_REWARDS:
        errors.append(f"learner.scale_rewards={cfg.learner.scale_rewards!r}: expected one of "
                      f"{', '.join(SCALE_REWARDS)}")
    from echo2.config_checks import learner_errors, pool_errors, run_errors

    errors += learner_errors(cfg) + pool_errors(cfg, remote) + run_errors(cfg, remote)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

