"""The `ministream` command as a fork of a process that imported torch and ministream once (a fork server, as
multiprocessing's "forkserver" start method): each command is still a process of its own, with its own pid, exit
status, signals, working directory, cores and file descriptors, but without the ~2.5 s of imports a fresh interpreter
pays first (torch alone is ~2 s on 2 cores), which the quick tier's few hundred commands paid again and again.

The server forks from its main thread; its other threads (one watching stdin, one waiting on each child, numpy's
BLAS pool, which registers its own fork handlers) hold no lock a child needs, and it has run no torch operation,
so no OpenMP pool is copied. What it imports is what the commands would import anyway (PRELOAD). A command whose
environment differs from the server's in a name those imports read gets a fresh interpreter: conftest.cli
decides (Launcher.takes).
"""

import contextlib
import importlib
import json
import locale
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)

# what the commands import lazily, once here: torch and the checkpoint side (convert, gguf, quantize's
# compressed-tensors and transformers), never vLLM (its import starts threads and reads its environment)
PRELOAD = (
    "torch",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "compressed_tensors.compressors",
    "compressed_tensors.quantization",
    "gguf",
    "ministream.cli",
    "ministream.commands.own",
    "ministream.checkpoint.convert",
    "ministream.checkpoint.quantize",
    "ministream.checkpoint.gguf",
    "ministream.checkpoint.reference",
    "ministream.checkpoint.fingerprint",
    "ministream.run.folder",
    "ministream.run.verify",
    "ministream.run.doctor",
)


# the environment the preloaded modules read when imported (torch and its OpenMP, numpy's BLAS, transformers and
# the Hugging Face hub, ministream.paths' MINISTREAM_CACHE, the interpreter's own): a command whose environment
# differs from the server's in one of these starts a fresh interpreter. Anything else is read when used, and the
# child has the command's whole environment (TORCHINDUCTOR_CACHE_DIR, which an engine sets, is read so).
READ_AT_IMPORT = re.compile(
    r"^(MINISTREAM_|TORCH(?!INDUCTOR_CACHE_DIR$)|PYTORCH_|OMP_|MKL_|KMP_|OPENBLAS_|GOTO|NUMPY|HF_|HUGGINGFACE_|"
    r"TRANSFORMERS_|TOKENIZERS_|SAFETENSORS_|PYTHON|LD_|CUDA)"
)

# what vLLM writes into the environment of a process that imports it (vllm/env_override.py) or configures an
# engine in it (its CPU platform's check_and_update_config): the suite's in-process engines leave these in the
# pytest worker's environment, where no user's shell has them, and a fresh interpreter would start with them too.
# A fork has them in its environment as well, and differs only in what they would have done at load (LD_PRELOAD's
# allocator and OpenMP, torch's NVML probe), which a command's results do not depend on.
VLLM_SETS = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LOCAL_WORLD_SIZE",
        "NUMEXPR_MAX_THREADS",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCHINDUCTOR_COMPILE_THREADS",
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
        "TRITON_CACHE_AUTOTUNING",
        "TILELANG_CLEANUP_TEMP_FILES",
    }
)
# and what scikit-learn's import sets (sklearn/__init__.py, setdefault), imported by some tests' libraries: for Intel's
# OpenMP, which torch's CPU wheel does not load; without them here every command after it in that worker ran fresh
LIBRARY_SETS = VLLM_SETS | {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket):
    (size,) = struct.unpack("!I", _exactly(conn, 4))
    return json.loads(_exactly(conn, size))


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the command, as `ministream ARGS` started by subprocess.run would be."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.sched_setaffinity(0, request["cores"])  # the cores of the test that asked, as a child of its own would have
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    # the console script's search path: its own folder first, not this server's (the tests, the working directory)
    sys.path[:] = [os.path.dirname(sys.argv[0]), *(p for p in sys.path if p not in ("", HERE))]
    from ministream.cli import console, exit_now

    code = 0
    try:
        console()
    except SystemExit as e:  # as the interpreter maps it
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr), 1)[1]
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT  # the interpreter's own exit on an uncaught Ctrl-C: killed by SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)  # what the interpreter's exit guarantees, without ~2 s of tearing down torch's modules


def serve(path: str) -> None:
    """Import PRELOAD, then fork a child per request on the Unix socket `path` until stdin closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    # ends with its parent: stdin closes (read on the raw descriptor: a thread blocked in sys.stdin.read() would
    # hold its buffer's lock into every child)
    threading.Thread(target=lambda: (os.read(0, 1), os._exit(0)), daemon=True).start()
    while True:
        conn, _ = server.accept()
        request = _recv(conn)
        _, fds, _, _ = socket.recv_fds(conn, 16, 3)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            _child(request, fds)  # exits, whatever the command does: never a second server
        for fd in fds:
            os.close(fd)
        threading.Thread(target=_wait, args=(conn, pid), daemon=True).start()


def _wait(conn: socket.socket, pid: int) -> None:
    _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    conn.close()


def _text(data: bytes) -> str:
    """As subprocess.run(text=True) decodes a stream: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


class Launcher:
    """The test side: start the server once, then run(argv) -> CompletedProcess, as subprocess.run with
    capture_output=True and text=True would return it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ministream-launcher-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(os.environ)
        self.said = tempfile.TemporaryFile()  # what the preloaded imports print: nothing, or no forks (takes)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {HERE!r}); import launcher; launcher.serve({self.path!r})",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.said,
            text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the launcher did not start")
        self.said.seek(0)
        if self.said.read():  # a warning an import printed: a fresh interpreter prints it, a fork would not
            self.close()

    def takes(self, env: dict | None) -> bool:
        """Whether a command with `env` (None: this process's) can be a fork: it differs from the server's, whose
        imports read it, in no name those imports read (READ_AT_IMPORT), what libraries set aside (LIBRARY_SETS)."""
        return not self.read_at_import(env) and self.proc.poll() is None

    def read_at_import(self, env: dict | None) -> list[str]:
        """The names `env` (None: this process's) changed since the server started that its imports read."""
        env = dict(os.environ) if env is None else env
        changed = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)} - LIBRARY_SETS
        return sorted(k for k in changed if READ_AT_IMPORT.match(k))

    def run(
        self, argv: list[str], env: dict | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess:
        with (
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            open(os.devnull) as null,
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
        ):
            conn.connect(self.path)
            env = dict(os.environ) if env is None else env
            _send(conn, {"argv": argv, "env": env, "cwd": os.getcwd(), "cores": sorted(os.sched_getaffinity(0))})
            socket.send_fds(conn, [b"x"], [null.fileno(), out.fileno(), err.fileno()])
            pid = _recv(conn)["pid"]
            conn.settimeout(timeout)
            try:
                rc = _recv(conn)["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(argv, rc, _text(out.read()), _text(err.read()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)
