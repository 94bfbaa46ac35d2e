"""The policy registry (:mod:`h2o_kv.registry`): one list of policies and options, one parser of ``--policy``."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from h2o_kv import registry
from h2o_kv.registry import (
    ACROSS_LAYERS,
    HEAD_ADAPTIVE,
    POLICY_NAMES,
    REGISTRY,
    SERVER_POLICIES,
    PolicySpec,
    parse_policy,
    split_specs,
)

# a value other than the default for every option type
OTHER = {
    "decay": 0.5,
    "window": 16,
    "kernel": 5,
    "pooling": "avg",
    "sinks": 2,
    "seed": 7,
    "alpha": 0.5,
    "recent_share": 0.5,
    "decode": "grow",
}


def test_the_policies_are_the_registry():
    from h2o_kv.cli import POLICY_NAMES as CLI_NAMES
    from h2o_kv.policies import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES == CLI_NAMES
    for name, cls in POLICIES.items():
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {o.name: o.default for o in REGISTRY[name].options} == {
            key: value for key, value in fields.items() if key not in ("heavy", "recent")
        }
    assert set(ACROSS_LAYERS) == {name for name, cls in POLICIES.items() if cls.across_layers}
    assert set(HEAD_ADAPTIVE) == {name for name, cls in POLICIES.items() if cls.head_adaptive and not cls.across_layers}
    assert set(SERVER_POLICIES) <= set(POLICY_NAMES) - set(ACROSS_LAYERS) and "full" in SERVER_POLICIES


def test_a_registry_line_that_does_not_match_its_class_fails_at_import(monkeypatch):
    import h2o_kv.policies as policies

    wrong = dict(REGISTRY, a2sf=registry.Entry("a2sf:A2SF", (registry.Option("decay", float, 0.9, 0, 1, True),)))
    monkeypatch.setattr(policies, "REGISTRY", MappingProxyType(wrong))
    with pytest.raises(TypeError, match="a2sf is A2SF"):
        policies._registered()
    monkeypatch.setattr(policies, "REGISTRY", MappingProxyType(dict(REGISTRY, h2o=registry.Entry("local:Local"))))
    with pytest.raises(TypeError, match="h2o is Local"):
        policies._registered()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_option_of_every_policy_round_trips_and_reaches_the_policy(name):
    from h2o_kv.policies import make_policy

    options = {option.name: OTHER[option.name] for option in REGISTRY[name].options}
    text = name + (":" + ",".join(f"{key}={value}" for key, value in options.items()) if options else "")
    spec = parse_policy(text)
    assert spec == PolicySpec(name, options) and spec.label == text
    assert parse_policy(spec.label) == spec and parse_policy(spec) == spec and hash(spec) == hash(parse_policy(text))
    policy = make_policy(text, 3, 4)
    assert type(policy).name == name and (policy.heavy, policy.recent) == (3, 4)
    assert {key: getattr(policy, key) for key in options} == options
    assert make_policy(name, 1, 1) == type(policy)(heavy=1, recent=1)  # no options: the defaults


def test_defaults_are_not_written_so_one_behaviour_has_one_label():
    assert parse_policy("a2sf:decay=0.99") == parse_policy("a2sf") and parse_policy("a2sf:decay=0.99").label == "a2sf"
    assert parse_policy(" snapkv : kernel = 5 , window=32 ").label == "snapkv:kernel=5"
    assert parse_policy("ada_snapkv:alpha=0.5,window=8").label == "ada_snapkv:window=8,alpha=0.5"  # registry order
    assert (
        parse_policy("a2sf:decay=1").options == {"decay": 1.0}
        and parse_policy("a2sf:decay=1").label == "a2sf:decay=1.0"
    )
    assert parse_policy("snapkv:window=8").values == {"window": 8, "kernel": 7, "pooling": "max"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("nope", "policy must be one of " + ", ".join(POLICY_NAMES) + "; got 'nope'"),
        ("a2sf:decay=0", "policy a2sf: decay must be a number in (0, 1]; got '0'"),
        ("a2sf:decay=1.5", "policy a2sf: decay must be a number in (0, 1]; got '1.5'"),
        ("a2sf:decay=nan", "policy a2sf: decay must be a number in (0, 1]; got 'nan'"),
        ("a2sf:decay=x", "policy a2sf: decay must be a number in (0, 1]; got 'x'"),
        ("a2sf:decay", "policy a2sf: decay needs a value (decay=...), a number in (0, 1]"),
        ("a2sf:decay=0.5,decay=0.6", "policy a2sf: decay is given twice"),
        ("snapkv:window=0", "policy snapkv: window must be an integer >= 1; got '0'"),
        ("snapkv:window=2.5", "policy snapkv: window must be an integer >= 1; got '2.5'"),
        ("snapkv:kernel=4", "policy snapkv: kernel must be an odd integer >= 1; got '4'"),
        ("snapkv:pooling=min", "policy snapkv: pooling must be one of max, avg; got 'min'"),
        ("sink:sinks=-1", "policy sink: sinks must be an integer >= 0; got '-1'"),
        ("random:seed=-3", "policy random: seed must be an integer >= 0; got '-3'"),
        ("ada_h2o:alpha=1.5", "policy ada_h2o: alpha must be a number in [0, 1]; got '1.5'"),
        ("h2o:decay=0.5", "policy h2o takes no options; got 'decay' (the syntax is h2o:option=value,...)"),
        ("a2sf:window=4", "policy a2sf takes decay; got 'window' (the syntax is a2sf:option=value,...)"),
        ("snapkv:,", "policy snapkv: no options after ':' (the syntax is snapkv:option=value,...)"),
        ("a2sf:", "policy a2sf: no options after ':' (the syntax is a2sf:option=value,...)"),
    ],
)
def test_bad_specs_are_one_line_naming_the_option_and_its_range(text, message):
    with pytest.raises(ValueError) as raised:
        parse_policy(text)
    assert str(raised.value) == message


def test_choices_restrict_the_names_and_are_listed():
    with pytest.raises(ValueError, match=r"^policy must be one of h2o, local, .*, window_h2o; got 'global_h2o'$"):
        parse_policy("global_h2o:alpha=0.5", SERVER_POLICIES)
    assert parse_policy("a2sf:decay=0.9", SERVER_POLICIES).name == "a2sf"


def test_lists_of_settings_split_between_specs():
    text = "h2o,snapkv:window=16,kernel=5,dynamic,kvpress:snapkv,a2sf:decay=0.9"
    assert split_specs(text) == ["h2o", "snapkv:window=16,kernel=5", "dynamic", "kvpress:snapkv", "a2sf:decay=0.9"]
    assert split_specs(" , ") == []


def test_the_registry_imports_no_torch():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, h2o_kv.registry; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip() == "False", done.stderr


# -- the setting of a run: its options reach the cache and the record --------------------------------------------


def test_a_setting_carries_its_policy_options_to_the_cache_and_the_record():
    from h2o_kv.harness.setting import KVSetting

    setting = KVSetting.of("a2sf:decay=0.5", heavy=2, recent=3)
    assert setting.name == setting.label == "a2sf:decay=0.5" and setting.spec == parse_policy("a2sf:decay=0.5")
    assert setting.fields()["policy"] == "a2sf:decay=0.5" and setting.bounded and setting.uses_h2o_cache
    cache = setting.make_cache()
    assert (type(cache.policy).name, cache.policy.decay, cache.policy.heavy, cache.policy.recent) == ("a2sf", 0.5, 2, 3)
    ratio = KVSetting.of("snapkv:window=4", budget=0.5).make_cache(prompt_length=20)
    assert (ratio.policy.window, ratio.policy.heavy) == (4, 5)
    assert KVSetting.of("a2sf", budget=0.2).make_cache(prompt_length=10).policy.decay == 0.99  # absent: defaults


def test_records_of_earlier_runs_keep_their_names():
    """A setting at its defaults is named as before options existed, so old records and item logs still match."""
    from h2o_kv.harness.setting import KVSetting, is_bounded

    assert KVSetting.of("a2sf:decay=0.99", budget=0.2).fields() == KVSetting.of("a2sf", budget=0.2).fields()
    assert KVSetting.of("a2sf", budget=0.2).fields()["policy"] == "a2sf" and "policy_options" not in (
        KVSetting.of("a2sf", budget=0.2).fields()
    )
    assert is_bounded("a2sf:decay=0.5") and not is_bounded("full") and not is_bounded("dynamic")
    assert KVSetting.of("kvpress:snapkv", budget=0.2).press == "snapkv"


def test_a_setting_names_the_option_of_a_bad_spec():
    from h2o_kv.harness.setting import KVSetting, check_name

    with pytest.raises(ValueError, match=r"^--policies snapkv: kernel must be an odd integer >= 1; got '2'$"):
        check_name("snapkv:kernel=2", "--policies")
    with pytest.raises(
        ValueError, match=r"^--policy must be one of dynamic, h2o, .*global_window_h2o; got 'kvpress:x'$"
    ):
        check_name("kvpress:x", "--policy", presses=False)
    with pytest.raises(ValueError, match=r"^setting a2sf: decay"):
        KVSetting("a2sf:decay=2")
