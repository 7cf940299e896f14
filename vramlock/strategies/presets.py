"""``--release http --preset NAME``: what each inference engine's API offers to free its GPU.

Each preset finds the server's address on its command line (``--upstream`` wins),
checks before anything starts that the command has what the preset needs (exit 125
otherwise), and, under ``--release auto``, recognises the command only where there
is no doubt: ``llama-server``, ``vllm serve`` or ``python -m
vllm.entrypoints.openai.api_server``, ``python -m sglang.launch_server``, ``ollama
serve``. ComfyUI runs as ``python main.py``, which says nothing: name its preset.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..errors import StrategyError
from ..net.address import Address, connect_host
from .base import Context, Interrupted, ReleaseTimeout, Settings
from .http import QUERY_TIMEOUT, SETTLE_TIMEOUT, Preset, flag, option, program, python_module
from .restart import RestartStrategy

# How long a restarted llama-server may take to load its model (/health 200).
READY_TIMEOUT = 300.0
# ComfyUI: what its PyTorch may keep reserved once it freed everything, what counts as
# the device's free memory growing, and how long without growth counts as settled.
COMFYUI_RESIDUE = 256 << 20
COMFYUI_GROWTH = 32 << 20
COMFYUI_SETTLE = 0.5


def _object(data: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise StrategyError(f"{where}: {what} answered something else than a JSON object")
    return data


def _number(data: dict[str, Any], key: str, what: str, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StrategyError(f"{where}: {what} has no number {key!r}")
    return int(value)


class LlamaServer(Preset, RestartStrategy):
    """llama.cpp's ``llama-server``: save every slot's KV cache to a file, end the server
    (its whole process group, as ``restart`` does); start it again, wait for ``/health``,
    restore the slots. The weights are read again from disk (the page cache, usually);
    the prompt cache comes back from the files.

    The slots are saved under ``--slot-save-path``; when the command has none, a private
    directory is made for the run and added to the command.
    """

    name = "http:llama-server"
    engine = "llama-server"
    default_port = 8080

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        self.saved: list[tuple[int, str]] = []  # (slot id, file name) of the last release
        self.slot_dir = option(ctx.child.argv, "--slot-save-path") or ""

    @classmethod
    def identifies(cls, command: list[str]) -> bool:
        return program(command) == "llama-server"

    @classmethod
    def refusal(cls, command: list[str]) -> str | None:
        sleep = option(command, "--sleep-idle-seconds")
        if sleep is not None and sleep.strip() != "-1":
            return (
                "llama-server's --sleep-idle-seconds cannot be used with it: a server that"
                " slept reloads its model on the next request without the GPU's token, and"
                " aborts when the memory is taken; drop that option"
            )
        if option(command, "--models-dir", "--models-preset") is not None:
            return "llama-server's router mode (--models-dir, --models-preset) is not supported"
        return None

    @classmethod
    def listens(cls, argv: list[str], env: Mapping[str, str]) -> Address:
        host = (option(argv, "--host") or env.get("LLAMA_ARG_HOST") or "127.0.0.1").split(",")[0]
        if host.endswith(".sock"):
            raise StrategyError(
                f"--preset llama-server: the server listens on a unix socket ({host});"
                " give it a TCP --host and --port"
            )
        if option(argv, "--ssl-key-file", "--ssl-cert-file") or env.get("LLAMA_ARG_SSL_KEY_FILE"):
            raise StrategyError("--preset llama-server: the server speaks HTTPS; this preset HTTP")
        port = option(argv, "--port") or env.get("LLAMA_ARG_PORT")
        return Address(connect_host(host), cls.port(port), cls.prefix(argv, env))

    @classmethod
    def prefix(cls, argv: list[str], env: Mapping[str, str]) -> str:
        return (option(argv, "--api-prefix") or env.get("LLAMA_ARG_API_PREFIX") or "").rstrip("/")

    @classmethod
    def api_key(cls, argv: list[str], env: Mapping[str, str]) -> str | None:
        keys = option(argv, "--api-key") or env.get("LLAMA_API_KEY")
        if keys:
            return keys.split(",")[0].strip()
        path = option(argv, "--api-key-file") or env.get("LLAMA_ARG_API_KEY_FILE")
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
            except (OSError, ValueError):
                return None  # the server cannot read it either: it will say so
            return lines[0] if lines else None
        return None

    @classmethod
    def prepare(
        cls, command: list[str], env: dict[str, str], scratch: contextlib.ExitStack
    ) -> list[str]:
        if option(command, "--slot-save-path") is not None:
            return command
        try:  # private (0700), in $TMPDIR; removed when the run ends
            made = tempfile.TemporaryDirectory(prefix="vramlock-slots-", ignore_cleanup_errors=True)
        except OSError as err:
            raise StrategyError(f"cannot make a directory for the slots: {err}") from None
        return [*command, "--slot-save-path", scratch.enter_context(made)]

    def free(self, deadline: float | None) -> None:
        self.saved = []
        status, raw = self.call("GET", "/props", deadline=deadline, at=self.address,
                                accept=lambda s: 200 <= s < 300 or s == 503)  # fmt: skip
        if status == 503:  # still loading its model: no cache to save yet
            RestartStrategy.release(self, deadline)
            return
        props = _object(self.decode(raw, "GET /props"), "GET /props", self.engine)
        # Any request to /slots would wake a sleeping server (and its cache is gone).
        if props.get("is_sleeping") is not True:
            for slot in self._slot_ids(props, deadline):
                filename = f"vramlock-slot{slot}.bin"
                raw = self.post(f"/slots/{slot}?action=save", {"filename": filename}, deadline)
                reply = _object(self.decode(raw, "a slot save"), "a slot save", self.engine)
                if _number(reply, "n_saved", "a slot save", self.engine) > 0:
                    self.saved.append((slot, filename))
                else:
                    self._remove(filename)  # an empty slot: nothing to bring back
        RestartStrategy.release(self, deadline)  # every process of the command gone

    def _slot_ids(self, props: dict[str, Any], deadline: float | None) -> list[int]:
        status, raw = self.call(
            "GET", "/slots", deadline=deadline, at=self.address,
            accept=lambda s: 200 <= s < 300 or s == 501,
        )  # fmt: skip
        if status == 501:  # --no-slots turns the list off, not the actions
            return list(range(_number(props, "total_slots", "GET /props", self.engine)))
        slots = self.decode(raw, "GET /slots")
        if not isinstance(slots, list):
            raise StrategyError(f"{self.engine}: GET /slots answered something else than a list")
        return [_number(_object(s, "GET /slots", self.engine), "id", "a slot", self.engine)
                for s in slots]  # fmt: skip

    def restore(self) -> None:
        if self.killed:  # always, after a release: started again, then the slots restored
            self.killed = False
            self.ctx.start_again()
        self._restore()

    def wait_ready(self) -> None:
        self.until(
            f"did not answer GET {self.ready_path} with 200",
            lambda: self.probe(self.ready_path, self.address) == 200,
            None,
            READY_TIMEOUT,
        )

    def take_back(self) -> None:
        self.wait_ready()
        saved, self.saved = self.saved, []
        failed = []
        for slot, filename in saved:
            if not os.path.exists(os.path.join(self.slot_dir, filename)):
                continue  # removed meanwhile: that slot starts empty
            try:
                self.post(f"/slots/{slot}?action=restore", {"filename": filename}, None)
            except StrategyError as err:
                failed.append(str(err))
            finally:
                self._remove(filename)
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise StrategyError(f"{failed[0]}{more}; those slots start empty")

    def _remove(self, filename: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.slot_dir, filename))


class Vllm(Preset):
    """vLLM's sleep mode, level 1: the weights go to host memory, the KV cache is
    dropped; done once ``/is_sleeping`` says so. ``/wake_up`` brings it back."""

    name = "http:vllm"
    engine = "vllm"
    default_port = 8000
    parallel = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                "--data-parallel-size", "-dp")  # fmt: skip

    @classmethod
    def identifies(cls, command: list[str]) -> bool:
        if program(command) == "vllm":
            return command[1:2] == ["serve"]
        return python_module(command) == "vllm.entrypoints.openai.api_server"

    @classmethod
    def refusal(cls, command: list[str]) -> str | None:
        if not flag(command, "--enable-sleep-mode", "--enable_sleep_mode"):
            return "vLLM needs --enable-sleep-mode on its command line"
        return None

    @classmethod
    def api_key(cls, argv: list[str], env: Mapping[str, str]) -> str | None:
        return super().api_key(argv, env) or env.get("VLLM_API_KEY") or None

    @classmethod
    def prepare(
        cls, command: list[str], env: dict[str, str], scratch: contextlib.ExitStack
    ) -> list[str]:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep endpoints exist only with it
        return command

    def free(self, deadline: float | None) -> None:
        self.post("/sleep?level=1", None, deadline)

        def sleeping() -> bool:
            reply = _object(self.get("/is_sleeping", deadline), "GET /is_sleeping", self.engine)
            return reply.get("is_sleeping") is True

        try:
            self.until("did not report is_sleeping", sleeping, deadline, SETTLE_TIMEOUT)
        except (StrategyError, Interrupted):
            # It may be asleep: resident and asleep, it would answer nobody. Wake it, or
            # failing that, have it ended (ReleaseTimeout): released either way.
            try:
                self.post("/wake_up", None, deadline)
            except (StrategyError, Interrupted):
                raise ReleaseTimeout from None
            raise

    def take_back(self) -> None:
        self.post("/wake_up", None, None)


class Sglang(Preset):
    """SGLang's memory saver: ``/release_memory_occupation`` returns once the memory is
    released; ``/resume_memory_occupation`` takes it back."""

    name = "http:sglang"
    engine = "sglang"
    default_port = 30000
    parallel = ("--tp-size", "--tensor-parallel-size", "--tp", "--pp-size",
                "--pipeline-parallel-size", "--dp-size", "--data-parallel-size", "--dp",
                "--ep-size", "--expert-parallel-size", "--ep")  # fmt: skip

    @classmethod
    def identifies(cls, command: list[str]) -> bool:
        return python_module(command) == "sglang.launch_server"

    @classmethod
    def refusal(cls, command: list[str]) -> str | None:
        if not flag(command, "--enable-memory-saver", "--enable_memory_saver"):
            return "SGLang needs --enable-memory-saver on its command line"
        return None

    def free(self, deadline: float | None) -> None:
        self.post("/release_memory_occupation", {}, deadline)

    def take_back(self) -> None:
        self.post("/resume_memory_occupation", {}, None)


class ComfyUI(Preset):
    """ComfyUI frees memory only between prompts, and ``POST /free`` only sets flags for
    its worker. So: wait until its queue is empty (``GET /queue``), ``POST /free``, then
    poll ``GET /system_stats`` until its first device shows the memory gone (the rule is
    in ``free``). Nothing to restore: ComfyUI loads models again when a prompt needs them.
    """

    name = "http:comfyui"
    engine = "comfyui"
    default_port = 8188
    ready_path = "/system_stats"

    @classmethod
    def listens(cls, argv: list[str], env: Mapping[str, str]) -> Address:
        host = "127.0.0.1"
        for i, arg in enumerate(argv[1:], 1):
            name, eq, value = arg.partition("=")
            if name == "--listen":  # --listen alone means every interface
                following = argv[i + 1] if i + 1 < len(argv) else "-"
                host = value if eq else ("0.0.0.0" if following.startswith("-") else following)
        return Address(connect_host(host.split(",")[0]), cls.port(option(argv, "--port")))

    def free(self, deadline: float | None) -> None:
        def idle() -> bool:
            queue = _object(self.get("/queue", deadline), "GET /queue", self.engine)
            return not queue.get("queue_running") and not queue.get("queue_pending")

        self.until("still had prompts queued", idle, deadline, SETTLE_TIMEOUT)
        self.post("/free", {"unload_models": True, "free_memory": True}, deadline, QUERY_TIMEOUT)
        # ComfyUI's vram_free counts what its PyTorch holds cached as free, so the device's
        # free memory is vram_free - torch_vram_free, and torch_vram_total is what its
        # PyTorch holds at all. Done when that is (nearly) nothing, or when the device's
        # free memory grew and then stopped growing (a custom node keeps a model of its
        # own: what could be freed was). A 200 from /free alone means nothing.
        most, grew_at = -1, 0.0  # the most device free memory seen, and when it grew

        def gone() -> bool:
            nonlocal most, grew_at
            stats = _object(self.get("/system_stats", deadline), "GET /system_stats", self.engine)
            devices = stats.get("devices")
            if not isinstance(devices, list) or not devices:
                raise StrategyError(f"{self.engine}: GET /system_stats lists no device")
            device = _object(devices[0], "GET /system_stats", self.engine)
            what = "GET /system_stats"
            held = _number(device, "torch_vram_total", what, self.engine)
            free = _number(device, "vram_free", what, self.engine)
            free -= _number(device, "torch_vram_free", what, self.engine)
            now = time.monotonic()
            if held <= COMFYUI_RESIDUE:
                return True
            if most < 0:
                most = free
            elif free > most + COMFYUI_GROWTH:
                most, grew_at = free, now
            return grew_at > 0 and now - grew_at >= COMFYUI_SETTLE

        self.until("did not free its memory", gone, deadline, SETTLE_TIMEOUT)

    def take_back(self) -> None:
        """Nothing: ComfyUI loads a model again when a prompt needs it."""


class Ollama(Preset):
    """Ollama: every model ``GET /api/ps`` lists on the GPU is unloaded with a
    ``keep_alive: 0`` request; done once none has ``size_vram`` left. Nothing to restore:
    Ollama loads a model again when a request names it."""

    name = "http:ollama"
    engine = "ollama"
    default_port = 11434
    ready_path = "/"  # "Ollama is running"

    @classmethod
    def identifies(cls, command: list[str]) -> bool:
        return program(command) == "ollama" and command[1:2] == ["serve"]

    @classmethod
    def listens(cls, argv: list[str], env: Mapping[str, str]) -> Address:
        raw = env.get("OLLAMA_HOST", "").strip() or "127.0.0.1"
        try:
            parts = urlsplit(raw if "://" in raw else f"http://{raw}")
            port = parts.port
        except ValueError:
            raise StrategyError(f"--preset ollama: bad OLLAMA_HOST {raw!r}") from None
        return Address(connect_host(parts.hostname or ""), port or cls.default_port)

    def _on_gpu(self, deadline: float | None) -> list[str]:
        reply = _object(self.get("/api/ps", deadline), "GET /api/ps", self.engine)
        models = reply.get("models") or []
        if not isinstance(models, list):
            raise StrategyError(f"{self.engine}: GET /api/ps lists no models")
        found = []
        for entry in models:
            model = _object(entry, "GET /api/ps", self.engine)
            if _number(model, "size_vram", "a model of GET /api/ps", self.engine) > 0:
                found.append(str(model.get("model") or model.get("name")))
        return found

    def free(self, deadline: float | None) -> None:
        for model in self._on_gpu(deadline):
            body = {"model": model, "keep_alive": 0, "stream": False}
            self.post("/api/generate", body, deadline)
        self.until("still had models on the GPU", lambda: not self._on_gpu(deadline),
                   deadline, SETTLE_TIMEOUT)  # fmt: skip

    def take_back(self) -> None:
        """Nothing: Ollama loads a model again when a request names it."""


PRESETS: dict[str, type[Preset]] = {
    cls.engine: cls for cls in (LlamaServer, Vllm, Sglang, ComfyUI, Ollama)
}


def ready_url(command: list[str], preset: str | None) -> str | None:
    """The path that answers 2xx once the server ``command`` starts serves, whatever the
    release strategy: its engine's, by ``--preset`` or by the command itself (where
    ``auto`` would know the engine); None for a server of no engine we know."""
    if preset in PRESETS:
        engine: type[Preset] | None = PRESETS[preset]
    else:
        engine = next((cls for cls in PRESETS.values() if cls.identifies(command)), None)
    if engine is None:
        return None
    return engine.prefix(command, os.environ) + engine.ready_path
