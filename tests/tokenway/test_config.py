"""Settings: CLI flags > `TOKENWAY_*` environment variables > defaults, validated once."""

from __future__ import annotations

import dataclasses
import typing

import msgspec
import pytest

from tokenway.config import ENV_PREFIX, Settings, load_settings


def test_defaults_apply_when_nothing_is_set() -> None:
    settings = load_settings({}, {})
    assert (settings.host, settings.port, settings.nats) == ("127.0.0.1", 8000, None)
    assert settings.request_timeout == 600.0
    assert settings.sim_engines is None  # `up` runs one, or none with --vllm-url


def test_up_runs_a_simulated_engine_unless_told_of_real_ones_or_none() -> None:
    from program.stages import up_stages

    stages = ["ingress", "render", "schedule", "dlq", "batch"]
    assert up_stages(load_settings({}, {})) == [*stages, "sim"]
    assert up_stages(load_settings({"sim_engines": 0}, {})) == stages
    assert up_stages(load_settings({"vllm_url": "http://gpu:8000"}, {})) == [*stages, "vllm"]
    pool = load_settings({"derender_placement": "pool", "sim_engines": 2}, {})
    assert up_stages(pool) == ["ingress", "render", "schedule", "derender", "dlq", "batch", "sim"]


def test_an_env_var_overrides_the_default() -> None:
    assert load_settings({}, {"TOKENWAY_PORT": "9000"}).port == 9000
    assert load_settings(None, {"TOKENWAY_HOST": "0.0.0.0"}).host == "0.0.0.0"


def test_a_flag_overrides_the_env_var() -> None:
    env = {"TOKENWAY_PORT": "9000", "TOKENWAY_HOST": "0.0.0.0"}
    settings = load_settings({"port": 9100}, env)
    assert settings.port == 9100
    assert settings.host == "0.0.0.0"  # no flag: the env var still applies


def test_a_flag_left_at_none_falls_through_to_env_then_default() -> None:
    assert load_settings({"port": None}, {"TOKENWAY_PORT": "9000"}).port == 9000
    assert load_settings({"port": None}, {}).port == 8000


def test_an_empty_env_var_counts_as_unset() -> None:
    assert load_settings({}, {"TOKENWAY_PORT": ""}).port == 8000


def test_an_empty_secret_is_kept_so_that_it_is_refused_not_taken_for_off() -> None:
    env = {"TOKENWAY_OBFUSCATION_KEY": "", "TOKENWAY_OBFUSCATION_KEY_FILE": ""}
    settings = load_settings({}, env)
    assert (settings.obfuscation_key, settings.obfuscation_key_file) == ("", "")


def test_env_strings_are_converted_to_the_field_types() -> None:
    env = {
        "TOKENWAY_PORT": "9000",
        "TOKENWAY_REQUEST_TIMEOUT": "0.5",
        "TOKENWAY_SIM_ITL": "0",
        "TOKENWAY_MAX_MODEL_LEN": "4096",
        "TOKENWAY_NATS": "nats://10.0.0.1:4222",
    }
    settings = load_settings({}, env)
    assert settings.port == 9000 and type(settings.port) is int
    assert settings.request_timeout == 0.5 and type(settings.request_timeout) is float
    assert settings.sim_itl == 0.0
    assert settings.max_model_len == 4096
    assert settings.nats == "nats://10.0.0.1:4222"


def test_string_flags_are_converted_too() -> None:
    assert load_settings({"port": "9200", "sim_ttft": "0.25"}, {}).sim_ttft == 0.25


def test_unknown_names_are_ignored() -> None:
    settings = load_settings({"no_such_flag": 1}, {"TOKENWAY_NO_SUCH": "x", "PORT": "1"})
    assert settings == load_settings({}, {})


def test_every_field_is_read_from_its_prefixed_env_var() -> None:
    defaults = load_settings({}, {})
    for name in Settings.__struct_fields__:
        default = getattr(defaults, name)
        if isinstance(default, bool):
            value: object = not default
        elif bool in typing.get_args(typing.get_type_hints(Settings)[name]):
            value = True
        elif typing.get_origin(hint := typing.get_type_hints(Settings)[name]) is typing.Literal:
            value = next(v for v in typing.get_args(hint) if v != default)
        elif isinstance(default, float) and 0 < default < 1:  # a share of something
            value = default / 2
        elif isinstance(default, int | float):
            value = default + 1
        else:  # str or None (a str or an int when set)
            value = "7"
        env = {ENV_PREFIX + name.upper(): str(value).lower()}
        assert str(getattr(load_settings({}, env), name)).lower() == str(value).lower(), name


def test_the_process_environment_is_read_when_no_env_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENWAY_PORT", "9001")
    assert load_settings({}).port == 9001


@pytest.mark.parametrize(
    ("flags", "env", "field"),
    [
        ({}, {"TOKENWAY_PORT": "eighty"}, "port"),
        ({}, {"TOKENWAY_PORT": "70000"}, "port"),
        ({"port": -1}, {}, "port"),
        ({}, {"TOKENWAY_REQUEST_TIMEOUT": "0"}, "request_timeout"),
        ({}, {"TOKENWAY_REQUEST_TIMEOUT": "soon"}, "request_timeout"),
        ({"sim_engines": -1}, {}, "sim_engines"),
        ({}, {"TOKENWAY_MAX_MODEL_LEN": "0"}, "max_model_len"),
        ({}, {"TOKENWAY_OUT_MAX_AGE": "60"}, "out_max_age"),
    ],
)
def test_an_invalid_value_exits_naming_the_field(
    flags: dict[str, object], env: dict[str, str], field: str
) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(flags, env)
    message = str(info.value.code)
    assert message.startswith("tokenway: invalid setting")
    assert f"`$.{field}`" in message


def test_settings_are_frozen() -> None:
    settings = load_settings({}, {})
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        settings.port = 1  # type: ignore[misc]
    assert msgspec.structs.replace(settings, port=1).port == 1
