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
