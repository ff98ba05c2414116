"""Every engine setting's default is written once.

``EngineArgs``' field defaults are the source; ``SchedulerConfig`` reads
the ones it shares, ``EngineArgs.scheduler_config`` carries every shared
field across, the profiles (``offline``, ``serve``) change only what
``PROFILES`` lists, and the CLI's engine options show or use the
profile's values. These tests fail when a default is written a second
time, or when a second copy drifts from the first.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import textwrap

import click
import pytest

from jaxserve.cli.bench import offline as bench_offline
from jaxserve.cli.generate import generate
from jaxserve.cli.plan_command import plan
from jaxserve.cli.queue_commands import worker
from jaxserve.engine import config as config_module
from jaxserve.engine.args import PROFILES, EngineArgs, profile_values, serving_reserved_seqs
from jaxserve.engine.config import SchedulerConfig

ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
#: the sizes the engine resolves and hands in; every other SchedulerConfig field is an EngineArgs one
RESOLVED = {"max_num_batched_tokens", "max_model_len", "num_blocks"}
SHARED = [f.name for f in dataclasses.fields(SchedulerConfig) if f.name not in RESOLVED]


def test_every_scheduler_setting_is_an_engine_setting():
    assert SHARED and all(name in ENGINE_FIELDS for name in SHARED)


def test_scheduler_config_writes_no_default_of_its_own_for_an_engine_setting():
    """Each shared field's default in config.py is ``_engine("<its name>")``,
    not a literal: a literal would be the second place that default is
    written."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_module.SchedulerConfig)))
    defaults = {
        node.target.id: node.value
        for node in tree.body[0].body  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
    }
    for name in SHARED:
        value = defaults[name]
        assert isinstance(value, ast.Call) and ast.unparse(value) == f"_engine({name!r})", (name, ast.unparse(value))


def test_a_bare_scheduler_config_has_the_engine_defaults():
    bare = SchedulerConfig()
    for name in SHARED:
        assert getattr(bare, name) == ENGINE_FIELDS[name].default, name


def test_the_scheduler_config_derived_from_default_engine_args_is_a_bare_one_of_those_sizes():
    args = EngineArgs()
    derived = args.scheduler_config(max_model_len=256, num_blocks=40)
    expected = SchedulerConfig(
        max_num_batched_tokens=args.resolve_max_num_batched_tokens(), max_model_len=256, num_blocks=40
    )
    assert derived == expected


def test_scheduler_config_carries_every_shared_field():
    """Each shared field set away from its default reaches the scheduler
    (a field the derivation forgot would come back with the default)."""
    changed = dict(
        max_num_seqs=12,
        block_size=8,
        policy="priority",
        interactive_reserved_seqs=3,
        interactive_reserved_blocks=2,
        enable_prefix_caching=False,
        long_prefill_token_threshold=24,
        max_num_waiting=99,
        interactive_prefill_alone=False,
        interactive_batch_prefill_tokens=5,
        interactive_recent_s=0.5,
        interactive_step_tokens=7,
        num_speculative_tokens=2,
    )
    assert set(changed) == set(SHARED)
    assert all(value != ENGINE_FIELDS[name].default for name, value in changed.items())
    derived = EngineArgs(max_num_batched_tokens=100, **changed).scheduler_config(max_model_len=64, num_blocks=20)
    assert {name: getattr(derived, name) for name in SHARED} == changed
    assert (derived.max_num_batched_tokens, derived.max_model_len, derived.num_blocks) == (100, 64, 20)


def test_the_serving_profile_keeps_the_default_workers_behaviour():
    """What a ``jaxserve worker`` with no engine options ran before the
    profile existed: priority ordering, no async scheduling, a quarter of
    32 sequences reserved, the interactive caps at 32."""
    args = EngineArgs.for_profile("serve")
    assert (args.policy, args.async_scheduling, args.max_num_seqs, args.interactive_reserved_seqs) == (
        "priority",
        False,
        32,
        8,
    )
    sched = args.scheduler_config(max_model_len=128, num_blocks=64)
    assert (sched.policy, sched.interactive_reserved_seqs) == ("priority", 8)
    assert (sched.interactive_batch_prefill_tokens, sched.interactive_step_tokens) == (32, 32)
    assert EngineArgs.for_profile("offline").max_num_batched_tokens == 2048
    assert EngineArgs.for_profile("engine") == EngineArgs()


@pytest.mark.parametrize(("seqs", "reserved"), [(1, 0), (2, 1), (7, 1), (8, 2), (64, 16)])
def test_the_serving_reserve_follows_the_given_max_num_seqs(seqs, reserved):
    assert serving_reserved_seqs(seqs) == reserved
    assert EngineArgs.for_profile("serve", max_num_seqs=seqs).interactive_reserved_seqs == reserved
    assert profile_values("serve", max_num_seqs=seqs)["interactive_reserved_seqs"] == reserved


def test_given_settings_win_over_the_profile():
    args = EngineArgs.for_profile("serve", max_num_seqs=64, interactive_reserved_seqs=0, async_scheduling=True)
    assert (args.interactive_reserved_seqs, args.async_scheduling, args.policy) == (0, True, "priority")


def test_profiles_name_only_engine_fields_and_an_unknown_one_is_refused():
    for changes in PROFILES.values():
        assert set(changes) <= set(ENGINE_FIELDS)
    with pytest.raises(ValueError, match="profile must be one of"):
        profile_values("online")  # type: ignore[arg-type]


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


def test_the_worker_shows_the_serving_profile_and_forwards_only_what_is_given():
    """``--help`` shows the serve profile's values; unset options stay
    ``None``, so only the operator's settings reach the factory."""
    serve = profile_values("serve")
    options = _options(worker)
    engine_options = [
        "model",
        "max_num_seqs",
        "interactive_reserved_seqs",
        "policy",
        "interactive_batch_prefill_tokens",
        "kv_cache_dtype",
    ]
    for name in engine_options:
        assert options[name].default is None, name
        assert options[name].show_default == str(serve[name]), name
    assert "compute_nice" not in options  # measured and dropped (commit c56ee78)


@pytest.mark.parametrize("command", [generate, bench_offline], ids=["generate", "bench offline"])
def test_offline_commands_take_their_defaults_from_the_offline_profile(command):
    offline = profile_values("offline")
    options = _options(command)
    for name in ("model", "tensor_parallel_size", "kv_cache_dtype"):
        assert options[name].default == offline[name], name


def test_plan_measures_the_offline_profiles_model_by_default():
    """``plan --measure`` builds an ``LLM`` (the offline profile), so its
    ``--model`` default is that profile's, not a second copy."""
    assert _options(plan)["model"].default == profile_values("offline")["model"]


def test_bench_offline_shows_the_offline_step_budget_and_leaves_it_to_the_profile():
    option = _options(bench_offline)["max_num_batched_tokens"]
    assert option.default is None and option.show_default == str(profile_values("offline")["max_num_batched_tokens"])


def test_the_worker_command_imports_no_jax():
    """The worker's process never imports JAX, so its options read the
    profile from a module that does not import it either."""
    code = "import sys, jaxserve.cli.main, jaxserve.cli.queue_commands; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
