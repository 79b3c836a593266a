"""Service configuration: flags beat environment variables of the same name, which beat defaults."""

from dataclasses import dataclass

from specinfer_rpc.config import ServerConfig, load_config, option


@dataclass
class ExampleConfig(ServerConfig):
    """An example service."""

    speculators: list[str] = option([], "addresses")
    expansion: list[int] = option([2, 1, 1], "expansion")
    adaptive: bool = option(True, "adaptive")


def test_flags_beat_environment_which_beats_defaults(monkeypatch):
    assert load_config(ExampleConfig, []) == ExampleConfig()
    monkeypatch.setenv("SPECINFER_SPECULATORS", "a:1,b:2")
    monkeypatch.setenv("SPECINFER_PORT", "7000")
    monkeypatch.setenv("SPECINFER_ADAPTIVE", "false")
    cfg = load_config(ExampleConfig, ["--port", "7001", "--expansion", "1,1,3"])
    assert cfg.speculators == ["a:1", "b:2"] and cfg.port == 7001 and cfg.expansion == [1, 1, 3]
    assert cfg.adaptive is False and load_config(ExampleConfig, ["--adaptive"]).adaptive is True


def test_the_managers_bearer_token_is_never_printed_with_its_configuration(monkeypatch, capsys):
    from manager_svc.__main__ import ManagerConfig

    monkeypatch.setenv("SPECINFER_AUTH_TOKEN", "s3cret-from-a-secret")
    cfg = load_config(ManagerConfig, ["--verifier", "v:1"])
    assert cfg.auth_token == "s3cret-from-a-secret"
    printed = capsys.readouterr().err
    assert "verifier='v:1'" in printed and "s3cret" not in printed
