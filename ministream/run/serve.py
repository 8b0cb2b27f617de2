"""serve: vLLM's OpenAI-compatible server (what `vllm serve` runs) with the patched vLLM of this environment.

The model is served under the folder's name (`out/demo/hf` -> "hf"; --name to choose another), so
clients name the same model whatever path the server was started with. The engine settings are this
machine's (engine.py): without a GPU, every core for the model and a KV cache of a quarter of the memory
available (1 to 64 GiB, split among --tp ranks), unless the environment already sets them; with a GPU,
vLLM's own defaults.

Before vLLM starts (a minute or more), serve checks what it can in a second and refuses in one line: the
folder (the folder check doctor runs too), --host (an address of this machine, or a name that resolves to
one), --port (1-65535, free: not held by another server, which is named), --max-model-len (1 to the folder's
max_position_embeddings), --vllm-args and vLLM's options beside serve's own (resolved as the installed vLLM
resolves them, prefixes and --config YAML included: setting nothing serve sets itself and nothing that would
serve other math than the folder's, vllm_options.py), --lora NAME=DIR (a PEFT adapter folder, each tensor of
the shape the folder's weights imply). It
says "ready" once its own server answers: /v1/models, asked with the API key, lists the served name with this
folder as its root, while the process it started runs, and the engine computes the folder's model: the prompt of
the folder's fingerprint comes back with its tokens by the rule for the width served (run/fingerprint.py); if
not (random weights, an override, another RoPE, a kernel that fails), one line says what differed, the server is
stopped and serve exits 2. A folder without a fingerprint is served with a warning; another folder's (its
weight files differ) is refused before vLLM starts. Each --lora adapter is served under its NAME beside the
model, with a spare LoRA slot (engine.lora_settings: vLLM's CPU LoRA ops would otherwise give base requests the
last adapter's update).

Stopping: SIGTERM or SIGINT (Ctrl-C) goes to the server. From vLLM 0.18 it drains (serve passes it
--shutdown-timeout, --stop-timeout less 5 s, unless given): new requests are refused, those in flight finish
within that time, then the engine shuts down; older releases abort what is in flight. A stream in flight can
keep vLLM's HTTP server waiting for its connection to close, so whatever of its process group is still
running --stop-timeout seconds (default 30) after the signal is killed (SIGKILL); a second signal kills it
at once. Either way serve ends within --stop-timeout seconds of the first signal (plus
about a second), leaves no process of the server behind, and exits 0: the stop was asked. A server that ends
unasked (its engine died, or it could not start) exits non-zero, whatever status vLLM gave it.
"""

import errno
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint.format import ADAPTER_FILE
from ..checkpoint.headers import read_header
from ..checkpoint.lora import PEFT_CONFIG, PEFT_WEIGHTS, check_peft
from ..fork.install import installed_vllm
from ..spec import train_config_from_hf
from . import engine, fingerprint, nodes, tuned, vllm_options
from .folder import check_servable
from .server import API_KEY, START_TIMEOUT, die_with_parent, get, kill_group, local_url, pgroup_alive

SHOWN = (engine.BIND, engine.KV_CACHE)  # the settings the start line shows
STOP_TIMEOUT = 30  # s from the first SIGTERM/SIGINT to SIGKILL of whatever of the server is left
# vLLM's --shutdown-timeout (vllm-project/vllm PR #36666, in 0.18.0): on SIGTERM it refuses new requests and lets
# those in flight finish for that long. serve gives it --stop-timeout less DRAIN_MARGIN s for the engine's exit.
DRAIN_SINCE = "0.18.0"
DRAIN_MARGIN = 5


def served_name(model: Path) -> str:
    return Path(model).resolve().name


def own_server_answers(url: str, name: str, model: Path, key: str | None) -> bool:
    """Whether the server at `url` is the one serve started: /v1/models (asked with the key) lists `name` with
    this folder as its root. /health alone is answered by whatever listens on the port."""
    try:
        with get(f"{url}/v1/models", 5, key) as r:
            cards = json.loads(r.read())["data"]
        root = str(Path(model).resolve())
        return any(c.get("id") == name and c.get("root") == root for c in cards)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


# s for the fingerprint's few tokens: only tells a hung engine from an answer, at any model size on a CPU
CHECK_TIMEOUT = 300


def _announce_when_ready(
    url: str,
    name: str,
    model: Path,
    key: str | None,
    proc: subprocess.Popen,
    held: dict | None = None,
    width: str | None = None,
    refused: list[str] | None = None,
) -> None:
    """Say "ready" once the server lists the folder and, where it has a fingerprint (`held`), computes its model by
    the rule for `width` (run/fingerprint.py); else one line saying what differed, into `refused`, and the
    server is stopped (SIGTERM, SIGKILL at STOP_TIMEOUT)."""
    deadline = time.monotonic() + START_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if own_server_answers(url, name, model, key) and proc.poll() is None:
            why = fingerprint.check_server(url, name, model, held, width, key, CHECK_TIMEOUT) if held else None
            if why is not None and proc.poll() is None and not _engine_died(url, key):
                _refuse(proc, why, model, refused if refused is not None else [])
                return
            if why is not None:  # its engine died meanwhile: the server ends by itself, and the main thread says so
                return
            body = json.dumps({"model": name, "prompt": "The river runs through", "max_tokens": 16, "temperature": 0})
            print(
                f"\nministream serve: ready at {url}/v1 (model {name!r}); try:\n"
                f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n",
                flush=True,
            )
            return
        time.sleep(1)
    # it exited, or never answered: the server's own log says why, and the main thread reports it


def _engine_died(url: str, key: str | None) -> bool:
    """Whether the server's engine is gone (vLLM's /health answers 503, or nothing answers): a request that failed
    then is the engine's death, which the server ends on, not a model that computes wrongly."""
    try:
        with get(f"{url}/health", 5, key):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 503
    except OSError:
        return True


def _refuse(proc: subprocess.Popen, why: str, model: Path, refused: list[str]) -> None:
    """Say in one line that the server does not compute the folder's model, and stop it."""
    refused.append(why)
    print(
        f"ministream serve: not ready: {why}; stopping the server (if the folder was changed on purpose, record "
        f"its fingerprint anew: ministream fingerprint {model})",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(STOP_TIMEOUT)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)


def vllm_args(text: str) -> list[str]:
    """--vllm-args split as the shell would, refused in one line if its quotes do not close or it sets an
    option serve sets itself."""
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise MiniStreamError(
            f"--vllm-args {text!r} cannot be split into options ({e}): close the quote, e.g. "
            "--vllm-args='--max-num-seqs 64 --chat-template \"{{ ... }}\"'"
        ) from None
    return vllm_options.check_spelled(args)


# vllm serve's name for an option serve has under its own: (serve's attribute, its type)
VLLM_NAMES = {
    "--model": ("model", Path),
    "--served-model-name": ("name", str),
    "--tensor-parallel-size": ("tp", int),
    "-tp": ("tp", int),
    "--pipeline-parallel-size": ("pp", int),
    "-pp": ("pp", int),
}


def split_options(args: Sequence[str], takes: dict[str, bool]) -> tuple[list[str], list[str]]:
    """serve's command line split into serve's own arguments and `vllm serve`'s options; takes: serve's option
    strings, each with whether it takes a value. An option serve does not have is vLLM's, and so is the word
    after it, unless that is an option too or, with no folder given yet, a converted folder (config.json in it):
    `--enable-prefix-caching out/m` serves out/m, `--max-num-seqs 64` passes 64 on."""
    args, ours, theirs = list(args), [], []
    folder_given = False
    while args:
        arg = args.pop(0)
        name, eq, _ = arg.partition("=")
        if not arg.startswith("-") or arg == "-":
            ours.append(arg)
            folder_given = True
        elif name in takes:
            ours.append(arg)
            if takes[name] and not eq and args:
                ours.append(args.pop(0))
        else:
            theirs.append(arg)
            value = args[0] if args and not eq else None
            if value is not None and not value.startswith("-"):
                if name in VLLM_NAMES or folder_given or not (Path(value) / "config.json").is_file():
                    theirs.append(args.pop(0))
    return ours, theirs


def passed_on(rest: Sequence[str], a) -> list[str]:
    """`vllm serve`'s options given to serve beside its own, as a recipe written for vLLM's image passes them
    (the image's entry point): those serve has under another name set it on `a` (--tensor-parallel-size 2 is
    --tp 2, --model DIR the folder), --headless is what a node of rank > 0 already is; the rest go to vLLM
    as --vllm-args would, checked the same way."""
    rest, extra = list(rest), []
    while rest:
        arg = rest.pop(0)
        option, eq, value = arg.partition("=")
        if option in VLLM_NAMES:
            attr, kind = VLLM_NAMES[option]
            if not eq:
                if not rest:
                    raise MiniStreamError(f"{option} needs a value")
                value = rest.pop(0)
            try:
                value = kind(value)
            except ValueError:
                raise MiniStreamError(f"{option} {value!r}: give a number") from None
            if attr == "model" and a.model is not None and Path(a.model) != value:
                raise MiniStreamError(f"two folders to serve, {a.model} and {option} {value}: give one")
            setattr(a, attr, value)
        elif option == "--headless":
            if a.nnodes < 2 or a.node_rank == 0:
                raise MiniStreamError(
                    "--headless: only a node of rank 1 or above runs without the API: give --nnodes N --node-rank R"
                )
        else:
            extra.append(arg)
    if a.model is None:
        raise MiniStreamError("give the converted folder to serve: ministream serve DIR (or --model DIR)")
    return vllm_options.check_spelled(extra, "the command line")


def vllm_command(
    model: Path,
    settings: engine.EngineSettings,
    host: str,
    port: int,
    name: str,
    given: Mapping[str, Sequence[str]],
    before: Sequence[str] = (),
    after: Sequence[str] = (),
    config: dict | None = None,
) -> list[str]:
    """The server's command line: the user's vLLM options (`given`: where they were given -> the options) as
    they are, between serve's own (`before`: the LoRA settings; `after`: the drain). Refused in one line, before
    a minute of engine start, where the installed vLLM resolves them (prefixes, underscores, dotted keys, the
    --config file) to a setting serve makes itself or to other math than the folder's (`config`, its
    config.json): vllm_options.check_resolved."""

    def command(options: Sequence[str]) -> list[str]:
        return engine.server_command(model, host, port, name, settings, [*before, *options, *after])

    quant = (config or {}).get("quantization_config")
    if any(given.values()):  # serve's own options alone need no check: building vLLM's parser takes ~10 s
        vllm_options.check_resolved(command, given, quant.get("quant_method") if isinstance(quant, dict) else None)
    return command([a for args in given.values() for a in args])


def drain_args(release: str | None, stop_timeout: float, extra: Sequence[str]) -> list[str]:
    """vLLM's drain on SIGTERM, where its release has it and the user set none of their own."""
    from packaging.version import Version

    if release is None or Version(Version(release).base_version) < Version(DRAIN_SINCE):
        return []  # older servers abort what is in flight at once
    for i, arg in enumerate(extra):  # the user's own drain: it must end before serve's bound kills it
        option, eq, value = arg.partition("=")
        if option in ("--shutdown-timeout", "--shutdown_timeout"):
            value = value if eq else (extra[i + 1] if i + 1 < len(extra) else "")
            try:
                asked = float(value)
            except ValueError:
                raise MiniStreamError(f"{option} {value!r}: give a number of seconds") from None
            if asked > stop_timeout - DRAIN_MARGIN:
                raise MiniStreamError(
                    f"{option} {value} drains longer than serve waits (--stop-timeout {stop_timeout:g} less "
                    f"{DRAIN_MARGIN} s for the engine's exit): give --stop-timeout {asked + DRAIN_MARGIN:g} or more"
                )
            return []
    seconds = int(stop_timeout - DRAIN_MARGIN)
    return ["--shutdown-timeout", str(seconds)] if seconds >= 1 else []


def check_max_model_len(asked: int | None, config: dict, model: Path) -> None:
    """--max-model-len within 1..max_position_embeddings: past the positions the model was trained on it would
    answer, wrongly (vLLM refuses it too, but after a minute and with a traceback)."""
    if asked is None:
        return
    most = config.get("max_position_embeddings")
    if asked < 1:
        raise MiniStreamError(f"--max-model-len {asked}: give a context of 1 token or more (up to {most})")
    if isinstance(most, int) and asked > most:
        raise MiniStreamError(
            f"--max-model-len {asked} is longer than the model's context, max_position_embeddings {most} in "
            f"{Path(model) / 'config.json'}: give {most} or less (or leave it out)"
        )


def check_listen(host: str, port: int) -> None:
    """--host and --port as vLLM's server will bind them (vllm.entrypoints: AF_INET6 for an IPv6 address,
    SO_REUSEADDR), bound and released now: a bad host, a port out of range or held by another server is
    refused in one line before a minute of engine start, and a server already on the port is never taken for
    this one."""
    if not 1 <= port <= 65535:
        raise MiniStreamError(f"--port {port}: give a TCP port from 1 to 65535 (default 8000)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (socket.gaierror, UnicodeError):
        raise MiniStreamError(
            f"--host {host!r} is neither an address nor a name this machine resolves: give one of its "
            "addresses, 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        ) from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise MiniStreamError(
                f"port {where} is in use{_holder(port)}: stop that server, or give another --port"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise MiniStreamError(
                f"--host {host} is not an address of this machine: give one of its addresses, 127.0.0.1 "
                "(this machine only) or 0.0.0.0 (every interface)"
            ) from None
        if e.errno == errno.EACCES:
            raise MiniStreamError(
                f"--port {port}: ports below 1024 need root (or CAP_NET_BIND_SERVICE): give --port 1024 or above"
            ) from None
        raise MiniStreamError(f"cannot listen on {where} ({e.strerror}): give another --host or --port") from None


def _holder(port: int) -> str:
    """' by pid N (its command)' for the process listening on `port`, where this process may see it."""
    try:
        import psutil  # vLLM's dependency: there wherever serve can start vLLM

        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" by pid {c.pid} ({' '.join(psutil.Process(c.pid).cmdline())[:120]})"
    except Exception:  # who holds it is a courtesy: the refusal stands without it
        pass
    return ""


def check_loras(loras: Sequence[str], config: dict, model: Path, name: str) -> list[tuple[str, Path, int]]:
    """--lora NAME=DIR, each a PEFT adapter folder (convert-lora's) whose tensors fit the served folder's
    weights, read from its safetensors header; (name, folder, rank) for engine.lora_server_args."""
    adapters: list[tuple[str, Path, int]] = []
    if not loras:
        return adapters
    cfg = train_config_from_hf(config, f"{Path(model) / 'config.json'}")
    for text in loras:
        lora_name, eq, path = text.partition("=")
        if not eq or not lora_name.strip() or not path:
            raise MiniStreamError(f"--lora {text!r}: give NAME=DIR, the name clients ask for and the adapter's folder")
        if lora_name in (name, *(n for n, _, _ in adapters)):
            raise MiniStreamError(
                f"--lora {text!r}: the name {lora_name!r} is already served"
                + (" (the base model's: --name)" if lora_name == name else "")
                + ": give each adapter a name of its own"
            )
        folder = Path(path)
        if not (folder / PEFT_CONFIG).is_file() or not (folder / PEFT_WEIGHTS).is_file():
            trainer = (folder / ADAPTER_FILE).is_file() or folder.name == ADAPTER_FILE
            todo = (
                f"it holds the trainer's adapter: convert it, ministream convert-lora {folder} OUT --base {model}, "
                f"and serve --lora {lora_name}=OUT"
                if trainer
                else f"convert the trainer's adapter into it: ministream convert-lora ADAPTER {folder} --base {model}"
            )
            raise MiniStreamError(
                f"--lora {text!r}: {folder} is not a PEFT adapter folder ({PEFT_CONFIG} and {PEFT_WEIGHTS}); {todo}"
            )
        shapes = {k: t.shape for k, t in read_header(folder / PEFT_WEIGHTS).items()}
        adapters.append((lora_name, folder, check_peft(folder, cfg, shapes)))
    return adapters


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_warning(host: str, env: dict) -> str | None:
    """A warning when the server would answer anyone who reaches `host` with no key asked of them."""
    if host in LOOPBACK or env.get(API_KEY):
        return None
    return (
        f"ministream serve: WARNING: listening on {host} without an API key: anyone who reaches this port "
        f"can use the model. Set {API_KEY}=<key> (or --api-key) so that requests must carry it."
    )


def serve(
    model: Path,
    settings: engine.EngineSettings = engine.SERVE_DEFAULTS,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    extra: Sequence[str] | Mapping[str, Sequence[str]] = (),
    stop_timeout: float = STOP_TIMEOUT,
    api_key: str | None = None,
    cluster: nodes.Plan | None = None,
    loras: Sequence[str] = (),
) -> int:
    """Run the server until it exits or this process gets SIGTERM/SIGINT; its exit status.

    settings: how its engine runs (--dtype, --tp, --pp, --max-model-len, --enforce-eager). cluster: this process
    is one node of a server over cluster.nnodes machines (nodes.py); rank 0 serves the API, the others run
    headless. api_key goes to vLLM through its environment (VLLM_API_KEY), never on a command line `ps` shows.
    loras: NAME=DIR, PEFT adapters served beside the model under their names. extra: vLLM's own options, or
    by where they were given ("the command line", "--vllm-args"), which a refusal names."""
    if not stop_timeout > 0:  # NaN too
        raise MiniStreamError(f"--stop-timeout {stop_timeout}: give a number of seconds above 0 (default 30)")
    nnodes, tp, pp = cluster.nnodes if cluster else 1, settings.tp, settings.pp
    if pp < 1 or (tp * pp) % nnodes:
        raise MiniStreamError(
            f"--tp {tp} x --pp {pp} = {tp * pp} ranks cannot be spread evenly over --nnodes {nnodes}: "
            f"give a --tp or --pp whose product is a multiple of {nnodes}"
        )
    local = tp * pp // nnodes  # the ranks this node runs
    engine.check_tp(local)
    # a folder vLLM can read in this dtype, and what this machine has (this node's share of the weights and its
    # ranks' KV caches), before minutes of start
    config = check_servable(model, settings.dtype, local, 1 / nnodes)
    check_max_model_len(settings.max_model_len, config, model)
    adapters = check_loras(loras, config, model, name or served_name(model))
    held = fingerprint.for_serving(model)  # another folder's fingerprint is refused here, before vLLM starts
    if importlib.util.find_spec("vllm") is None:
        raise MiniStreamError(f"vllm is not installed in {sys.prefix}: run `make install` first") from None
    name = name or served_name(model)
    installed = installed_vllm()
    release = installed[0] if installed else None
    if cluster:
        nodes.check_release(installed)
        env = engine.node_env(local, nodes.local_address(cluster.master_addr), nnodes=nnodes, release=release)
    else:
        env = engine.engine_env(local)
    if api_key:
        env[API_KEY] = api_key
    vllm_options.check_environment(env, bool(adapters))
    headless = cluster is not None and cluster.rank > 0
    given = {"--vllm-args": list(extra)} if not isinstance(extra, Mapping) else {k: list(v) for k, v in extra.items()}
    before = engine.lora_server_args(adapters) if adapters else []  # serve's own, which the user's follow
    after = [] if headless else drain_args(release, stop_timeout, [a for args in given.values() for a in args])
    if not headless:
        check_listen(host, port)
    cmd = vllm_command(model, settings, host, port, name, given, before, after, config)
    if not headless and (warning := exposure_warning(host, env)):
        print(warning, file=sys.stderr, flush=True)
    if cluster:
        cmd = engine.node_command(cmd, pp, nnodes, cluster.rank, cluster.master_addr, cluster.master_port)
    elif pp > 1:
        cmd += ["--pipeline-parallel-size", str(pp)]
    url = local_url(host, port)
    shown = " ".join(f"{k}={env[k]}" for k in (*SHOWN, "VLLM_HOST_IP") if k in env)
    print(f"ministream serve: {shown} {' '.join(cmd)}", flush=True)
    if not engine.has_gpu() and local == 1:
        said = tuned.describe(tuned.chosen(), offline=False)
        print(f"ministream serve: CPU defaults (yours win): {said}", flush=True)
    peers: dict = {}
    if cluster:
        mine = nodes.card(model, settings, nnodes, release)
        peers = nodes.gather(cluster, mine) if cluster.rank == 0 else {0: nodes.join(cluster, mine)}
    if headless and cluster:
        print(f"ministream serve: node {cluster.rank} of {nnodes}, headless: node 0 serves the API", flush=True)
    else:
        print(
            f"ministream serve: will listen on {url} once loaded (model {name!r}"
            + "".join(f", adapter {n!r}" for n, _, _ in adapters)
            + "); Ctrl-C or SIGTERM stops it",
            flush=True,
        )
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    lost: list[int] = []
    if peers:
        nodes.watch(peers, lambda rank: _node_lost(rank, proc, lost))
    refused: list[str] = []  # why the server does not compute the folder's model (its fingerprint)
    if not headless:
        if unchecked := fingerprint.unchecked(model, held, settings.max_model_len):  # served, and said so
            print(f"ministream serve: warning: {unchecked}", file=sys.stderr, flush=True)
            held = None
        key = env.get(API_KEY)
        width = fingerprint.served_width(config, settings.dtype)
        threading.Thread(
            target=_announce_when_ready, args=(url, name, model, key, proc, held, width, refused), daemon=True
        ).start()
    stopping: list[float] = []  # when the first stop signal came
    rc = _wait_forwarding_signals(proc, stopping, stop_timeout)
    if lost and not stopping:
        print(
            f"ministream serve: node {lost[0]} was lost (its process ended or its machine is gone); this node "
            f"stopped its server: restart every node",
            file=sys.stderr,
            flush=True,
        )
        return 3
    if refused and not stopping:  # said in one line by _refuse
        return 2
    if stopping:  # asked: stopped, however it ended (by itself, or killed at the bound)
        print("ministream serve: stopped", flush=True)
        return 0
    # nobody asked it to stop: vLLM ends its server with status 0 when the engine dies
    print(
        f"ministream serve: the server stopped unasked (status {rc}): its engine died or it could not "
        "start; the reason is in the log above",
        file=sys.stderr,
        flush=True,
    )
    return 1 if rc == 0 else rc if rc > 0 else 128 - rc


def _node_lost(rank: int, proc: subprocess.Popen, lost: list[int]) -> None:
    """A watcher found node `rank` gone: vLLM would hang on its collective, so stop it now."""
    lost.append(rank)
    kill_group(proc.pid)


def _wait_forwarding_signals(proc: subprocess.Popen, stopping: list, stop_timeout: float) -> int:
    """The server's exit status. SIGTERM/SIGINT meanwhile go to it; whatever of its process group is left
    stop_timeout seconds after the first is killed, all of it at once on a second. Its group is gone on return:
    once asked, by the same deadline; unasked (its engine died), at once."""

    def forward(signum, _frame):
        stopping.append(time.monotonic())
        try:
            if len(stopping) == 1:
                os.kill(proc.pid, signum)
            else:
                kill_group(proc.pid)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    killed = False
    try:
        # the server's exit, then the rest of its group (engine processes still exiting): both by the deadline
        while proc.poll() is None or (stopping and not killed and pgroup_alive(proc.pid)):
            if stopping and not killed and time.monotonic() - stopping[0] >= stop_timeout:
                print(
                    f"ministream serve: still running {stop_timeout:g}s after the signal (a stream held it open, "
                    "or its engine did not stop): killing it",
                    file=sys.stderr,
                    flush=True,
                )
                kill_group(proc.pid)
                killed = True  # then only the server's own exit is awaited: SIGKILL cannot be refused
            time.sleep(0.1)
        return proc.returncode
    finally:
        kill_group(proc.pid)  # unasked, or this thread interrupted: nothing of the server outlives serve
        for s, h in old.items():
            signal.signal(s, h)
