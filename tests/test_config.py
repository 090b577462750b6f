"""Config: defaults work, and every bad key or value is an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamapool.config import ConfigError, from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_default_config_loads_unedited() -> None:
    cfg = load_config(ROOT / "configs" / "default.toml")
    models = ROOT / "models"  # (a worktree's may be a link to another's)
    assert [Path(m.path).resolve() for m in cfg.models] == [
        (models / "gemma-3-270m-q4_k_m.gguf").resolve(), (models / "SmolLM2-135M-Instruct.Q4_1.gguf").resolve()]
    # the base model first (a request without "model" gets it), the instruction-tuned one beside it,
    # its own template from the GGUF
    assert [m.name for m in cfg.models] == ["gemma-3-270m", "smollm2-135m-instruct"]
    assert cfg.models[1].chat_template == "" and cfg.models[1].devices == "cpu"
    assert cfg.workers.devices == "auto" and cfg.workers.slots == 8 and cfg.workers.cpu_workers == 2
    assert cfg.model.max_batch_tokens == 0 and cfg.model.n_ubatch == 1024
    assert cfg.frontend.startswith("ipc://") and cfg.frontend.endswith("frontend.sock")


def test_issue_example_keys_work() -> None:
    cfg = from_dict({
        "server": {"frontend": "ipc:///run/llamapool/frontend.sock"},
        "model": {"path": "/m.gguf"},
        "workers": {"devices": ["GPU-abc", 1], "cpu_workers": 3, "slots": 16, "env": {"X": 1}},
    })
    assert cfg.frontend == "ipc:///run/llamapool/frontend.sock"
    assert cfg.workers.devices == ["GPU-abc", 1] and cfg.workers.env == {"X": "1"}


@pytest.mark.parametrize("raw, key", [
    ({"model": {"path": "m", "bogus": 1}}, "model.bogus"),
    ({"model": {"path": "m"}, "workerz": {}}, "workerz"),
    ({"model": {}}, "model.path"),
    ({"model": {"path": "m"}, "workers": {"slots": 0}}, "workers.slots"),
    ({"model": {"path": "m"}, "workers": {"slots": "8"}}, "workers.slots"),
    ({"model": {"path": "m"}, "workers": {"devices": "gpu"}}, "workers.devices"),
    ({"model": {"path": "m"}, "workers": {"devices": [-1]}}, "workers.devices"),
    ({"model": {"path": "m"}, "workers": {"env": {"A": [1]}}}, "workers.env"),
    ({"model": {"path": "m", "max_batch_tokens": 8}, "workers": {"slots": 8}}, "model.max_batch_tokens"),
    ({"model": {"path": "m", "n_batch": 256}}, "model.n_batch: renamed to model.max_batch_tokens"),
    ({"model": {"path": "m", "prefill_chunk": 256}}, "model.prefill_chunk: replaced by model.max_batch_tokens"),
    ({"model": {"path": "m"}, "server": {"queue_timeout": -1}}, "server.queue_timeout"),
    ({"model": {"path": "m"}, "server": {"frontend": 5}}, "server.frontend"),
    ({"model": {"path": "m"}, "model2": 1}, "model2"),
])
def test_bad_config_names_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        from_dict(raw)


def test_missing_file_and_bad_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[model\npath=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "c.toml").write_text('[model]\npath = "m.gguf"\n[workers]\nslots = -2\n')
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(tmp_path / "c.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "workers.slots" in r.stderr


def test_http_table_is_optional_and_checked(tmp_path: Path) -> None:
    assert from_dict({"model": {"path": "m"}}).http is None
    cfg = load_config(ROOT / "configs" / "default.toml")
    assert cfg.http is not None and cfg.http.host_port == ("127.0.0.1", 8000) and cfg.http.processes == 1
    with pytest.raises(ConfigError, match=r"http\.listen"):
        from_dict({"model": {"path": "m"}, "http": {"listen": "8000"}})
    with pytest.raises(ConfigError, match=r"http\.api_keys_file"):
        from_dict({"model": {"path": "m"}, "http": {"api_keys_file": str(tmp_path / "none")}})
    (tmp_path / "empty").write_text("# no keys\n")
    with pytest.raises(ConfigError, match="holds no key"):
        from_dict({"model": {"path": "m"}, "http": {"api_keys_file": str(tmp_path / "empty")}})


def test_the_responses_store_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[http] responses_store``, ``responses_ttl`` (seconds or a duration), ``responses_max_mb``; the
    file is in $STATE_DIRECTORY (systemd's StateDirectory=), else the runtime dir."""
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = from_dict({"model": {"path": "m"}, "server": {"runtime_dir": str(tmp_path)},
                     "http": {"responses_ttl": "2h", "responses_max_mb": 0.5}})
    assert cfg.http is not None and cfg.http.responses_store and cfg.http.responses_ttl == 7200.0
    assert cfg.http.responses_max_mb == 0.5 and cfg.responses_path == str(tmp_path / "responses.sqlite")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/llamapool")
    assert cfg.responses_path == "/var/lib/llamapool/responses.sqlite"
    assert from_dict({"model": {"path": "m"}, "http": {"responses_store": False}}).responses_path == ""
    assert from_dict({"model": {"path": "m"}}).responses_path == ""  # no gateway, no store
    for key, value in (("responses_ttl", 0), ("responses_ttl", "soon"), ("responses_max_mb", -1),
                       ("responses_store", "yes")):
        with pytest.raises(ConfigError, match=f"http\\.{key}"):
            from_dict({"model": {"path": "m"}, "http": {key: value}})


# ---------------------------------------------------------------- [[models]]


def _two(a: dict, b: dict, **sections: dict) -> dict:
    return {"models": [{"name": "a", "path": "/a.gguf", **a}, {"name": "b", "path": "/b.gguf", **b}], **sections}


def test_models_tables_take_the_workers_keys_as_defaults_and_override_them() -> None:
    cfg = from_dict(_two({"slots": 2, "devices": [[0, 1], [2, 3]], "tensor_split": [3, 1]}, {},
                         workers={"devices": "cpu", "cpu_workers": 3, "slots": 6, "threads": 2}))
    a, b = cfg.models
    assert (a.name, a.slots, a.devices, a.groups, a.tensor_split) == ("a", 2, [[0, 1], [2, 3]], [[0, 1], [2, 3]],
                                                                      (3.0, 1.0))
    assert (b.slots, b.devices, b.cpu_workers, b.threads, b.groups) == (6, "cpu", 3, 2, None)
    assert cfg.model is a and cfg.model_name == "a" and cfg.model_names == ["a", "b"] and cfg.models_table


def test_legacy_model_table_is_a_pool_of_one_named_by_its_file() -> None:
    cfg = from_dict({"model": {"path": "/srv/Llama-8B.gguf"}, "workers": {"devices": [1], "slots": 3}})
    assert cfg.model_names == ["Llama-8B"] and not cfg.models_table
    assert cfg.model.devices == [1] and cfg.model.slots == 3 and cfg.model.groups == [[1]]
    named = from_dict({"models": [{"path": "/srv/Llama-8B.gguf"}]})
    assert named.model_names == ["Llama-8B"] and named.models_table


@pytest.mark.parametrize("raw, match", [
    (_two({"devices": [0, 1]}, {"devices": [[1, 2]]}),
     r"models\[1\]\.devices: GPU 1 of model 'b' is also in model 'a' \(models\[0\]\.devices\)"),
    (_two({"devices": ["GPU-x"]}, {"devices": ["GPU-x"]}), r"models\[1\]\.devices: GPU 'GPU-x'.*'a'"),
    (_two({"devices": [[0, 1], [1]]}, {}), r"models\[0\]\.devices: GPU 1 is listed twice"),
    (_two({"devices": [[0, "x"]]}, {}), r"models\[0\]\.devices: must be"),
    (_two({"devices": [[]]}, {}), r"models\[0\]\.devices: must be"),
    (_two({"tensor_split": [1, 1]}, {}), r"models\[0\]\.tensor_split: has 2 shares"),
    (_two({"devices": [[0, 1]], "tensor_split": [1]}, {}), r"models\[0\]\.tensor_split: has 1 shares"),
    (_two({"devices": [[0, 1]], "tensor_split": [-1, 2]}, {}), r"models\[0\]\.tensor_split: must be"),
    (_two({}, {"name": "a"}), r"models\[1\]\.name: 'a' is also the name of models\[0\]"),
    (_two({"name": "bad name"}, {}), r"models\[0\]\.name: 'bad name' must be"),
    (_two({"slots": 0}, {}), r"models\[0\]\.slots: must be > 0"),
    (_two({"cpu_workers": -1}, {}), r"models\[0\]\.cpu_workers: must be > 0"),
    (_two({}, {"path": ""}), r"models\[1\]\.path: is required"),
    (_two({}, {"bogus": 1}), r"models\[1\]\.bogus: unknown key"),
    (_two({"max_batch_tokens": 4, "slots": 4}, {}), r"models\[0\]\.max_batch_tokens: must be >"),
    ({"models": []}, r"models: must be one or more"),
    ({"models": [5]}, r"models\[0\]: must be a table"),
    ({"model": {"path": "/m"}, "models": [{"path": "/m"}]}, r"models: give either \[model\]"),
])
def test_bad_models_config_names_the_key(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_dict(raw)


def test_default_config_documents_the_model_keys() -> None:
    text = (ROOT / "configs" / "default.toml").read_text()
    for key in ("[[models]]", "tensor_split", "cpu_workers", "name ="):
        assert key in text, key


# ---------------------------------------------------------------- the declared keys (config.py, tables.py)


def _sections() -> dict[str, type]:
    from llamapool import config

    return {"server": config.ServerConfig, "model": config.ModelConfig, "workers": config.WorkersConfig,
            "pool": config.PoolConfig, "http": config.HttpConfig, "metrics": config.MetricsConfig,
            "security": config.SecurityConfig, "log": config.LogConfig, "node": config.NodeConfig,
            "kv_events": config.KVEventsConfig}


def test_every_key_written_at_its_default_loads_as_the_default() -> None:
    """A table giving each key its documented default is the default: no declared constraint refuses a
    default (``replicas = []``, ``idle_unload = -1``, ``tenant_header = ""``, ...)."""
    import dataclasses

    from llamapool.tables import table

    def toml(v: object) -> object:
        return [toml(x) for x in v] if isinstance(v, tuple) else v

    for name, cls in _sections().items():
        default = cls()
        raw = {f.name: toml(getattr(default, f.name)) for f in dataclasses.fields(cls)}
        assert table(name, cls, raw) == default, name
    assert from_dict({"models": [{"path": "/m.gguf", "replicas": []}]}).models[0].replicas == ()


def test_a_key_with_choices_names_every_choice() -> None:
    """Each key declared with a Literal (log.format, model.task, ...) answers a wrong value with all it takes."""
    import typing

    from llamapool.tables import _hints, _unwrap

    found = 0
    for name, cls in _sections().items():
        for key, hint in _hints(cls).items():
            base = _unwrap(hint)[0]
            if typing.get_origin(base) is not typing.Literal:
                continue
            raw: dict = {"model": {"path": "/m.gguf"}}
            raw.setdefault(name, {})[key] = "bogus"
            with pytest.raises(ConfigError) as e:
                from_dict(raw)
            message = str(e.value)
            assert message.startswith(f"{name}.{key}: must be ") and message.endswith("got 'bogus'"), message
            assert all(f'"{v}"' in message for v in typing.get_args(base) if v), message
            found += 1
    assert found >= 6  # log.format, log.level, model.engine, pooling, task, load


@pytest.mark.parametrize("raw, message", [
    ({"workers": {"kv_host": "lots"}}, "workers.kv_host: must be \"auto\", \"0\" or a size such as \"16GiB\", "
                                       "got 'lots'"),
    ({"workers": {"env": {"A": [1]}}}, "workers.env: must be a table of NAME = \"value\", got {'A': [1]}"),
    ({"server": {"queue_timeout": float("nan")}}, "server.queue_timeout: must be > 0, got nan"),
    ({"http": {"responses_ttl": "0s"}}, "http.responses_ttl: must be > 0 seconds, got '0s'"),
    ({"pool": {"idle_unload": True}}, "pool.idle_unload: must be seconds or a duration such as \"90s\", \"15m\", "
                                      "\"2h\", got True"),
    ({"log": {"level": 5}}, "log.level: must be \"debug\", \"info\", \"warning\" or \"error\", got 5"),
    ({"models": [{"path": "/m", "replicas": [1]}]}, "models[0].replicas: must be [at least, at most] workers"),
    ({"models": [{"path": "/m", "devices": [[0, 1]], "tensor_split": [0, 0]}]},
     "models[0].tensor_split: must have a share above 0 (a share per GPU of a group), got [0.0, 0.0]"),
    ({"models": [{"path": "/m", "lora": [{"path": "a.gguf"}]}]}, "models[0].lora[0].name: is required (1 to 64"),
    ({"models": [{"path": "/m", "speculative": 1}]},
     "models[0].speculative: must be \"auto\", \"ngram\", \"off\" or \"draft:<a GGUF path>\", got 1"),
])
def test_errors_name_the_key_and_what_it_takes(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"path": "/m"}, **raw} if "models" not in raw else raw)
    assert str(e.value).startswith(message), str(e.value)
