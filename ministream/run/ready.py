"""ready: whether a server answers with its model, for an orchestrator's readiness probe (`ministream ready`).

/health says the HTTP server is up (liveness); readiness asks more: /v1/models lists the model, and the model
computes the folder's: the fingerprint's prompt (checkpoint/fingerprint.py) comes back with the folder's tokens
by the rule for the width served (run/fingerprint.py). A server that is still loading, is draining on SIGTERM
(vLLM refuses new requests then), whose engine died, or that computes another model (random weights, an
override, another RoPE, a kernel that fails) is not ready. The folder is --folder, else the model card's `root`
where that is a folder on this machine (the probe runs beside the server, in its container). Without a
fingerprint there (a folder written before them; a server on another machine) a one-token completion is asked,
as before, and the answer says the model was not checked; with --folder, a missing fingerprint is not ready.
The width: --dtype as the server was given it; without it the top-k rule, which every width passes, so that a
probe never fails a server that is right (serve itself, which knows its dtype, holds float32 to identical ids).
The key is VLLM_API_KEY's (or OPENAI_API_KEY's), as the server's, so a probe reads it from the same Secret;
nothing heavier than urllib is imported, since a probe runs every few seconds.
"""

import json
import os
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint import fingerprint as recorded
from . import fingerprint
from .server import call, complete


def default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('PORT', '8000')}"


def ready(
    url: str, model: str | None = None, timeout: float = 5, folder: Path | None = None, dtype: str | None = None
) -> tuple[str, str]:
    """The served model's name once it computes the folder's model (or, with no fingerprint to hold it to,
    answers a one-token completion), and how that was shown; MiniStreamError saying what is not."""
    url = url.rstrip("/")
    cards = models(url, timeout)
    names = [card.get("id") for card in cards]
    if model is None and names:
        model = names[0]
    if model not in names:
        raise MiniStreamError(f"{url} serves {', '.join(map(str, names)) or 'no model'}, not {model!r}")
    model = str(model)
    root = next(card.get("root") for card in cards if card.get("id") == model)
    where = folder or (Path(root) if isinstance(root, str) and (Path(root) / "config.json").is_file() else None)
    fp = recorded.read(where) if where is not None else None
    if where is None or fp is None:
        if folder is not None:
            raise MiniStreamError(
                f"{folder / recorded.FILE} is missing: record it, ministream fingerprint {folder} (or drop --folder)"
            )
        one_token(url, model, timeout)
        return model, f"not checked against a fingerprint: {where or root!r} has none here"
    if why := recorded.stale(where, fp):
        raise MiniStreamError(why)
    try:
        config = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MiniStreamError(f"{where / 'config.json'} cannot be read ({e}): is {where} the served folder?") from None
    width = None if "quantization_config" in config else dtype  # a quantized width's rule is the top-k one
    if why := fingerprint.check_server(url, model, where, fp, width, timeout=timeout):
        raise MiniStreamError(why)
    return model, f"computes {where}'s model ({fingerprint.rule(width)})"


def models(url: str, timeout: float) -> list[dict]:
    """The model cards /v1/models lists; MiniStreamError naming the URL where it does not answer with a list."""
    try:
        status, body = call(f"{url}/v1/models", timeout=timeout)
    except ValueError as e:  # not JSON
        raise MiniStreamError(f"{url}/v1/models answered something that is not JSON ({e})") from None
    except OSError as e:
        raise MiniStreamError(f"{url}/v1/models does not answer ({e})") from None
    if status != 200:
        raise MiniStreamError(f"{url}/v1/models answered HTTP {status}: {str(body)[:200]}")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(card, dict) for card in data):
        raise MiniStreamError(
            f'{url}/v1/models answered {json.dumps(body)[:120]}, not a list of models ({{"data": [...]}}): '
            "is an OpenAI-compatible server on that port?"
        )
    return data


def one_token(url: str, model: str, timeout: float) -> None:
    """A one-token greedy completion of `model` comes back with a token; MiniStreamError where not."""
    try:
        status, body = complete(url, model, "ready", 1, timeout=timeout)
    except (OSError, ValueError) as e:
        raise MiniStreamError(f"a one-token completion of {model!r} at {url} failed ({e})") from None
    choices = body.get("choices") if isinstance(body, dict) else None
    if status != 200 or not choices:
        raise MiniStreamError(f"a one-token completion of {model!r} answered HTTP {status}: {str(body)[:200]}")
