"""ready: whether a server answers with its model, for an orchestrator's readiness probe (`ministream ready`).

/health says the HTTP server is up (liveness); readiness asks more: /v1/models lists the model, and a one-token
greedy completion of it comes back with a token. A server that is still loading, is draining on SIGTERM (vLLM
refuses new requests then), or whose engine died is not ready. The key is VLLM_API_KEY's (or OPENAI_API_KEY's),
as the server's, so a probe reads it from the same Secret; nothing heavier than urllib is imported, since a
probe runs every few seconds.
"""

import os

from .. import MiniStreamError
from .server import call, complete


def default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('PORT', '8000')}"


def ready(url: str, model: str | None = None, timeout: float = 5) -> str:
    """The served model's name once it answers a one-token completion; MiniStreamError saying what is not."""
    url = url.rstrip("/")
    try:
        status, body = call(f"{url}/v1/models", timeout=timeout)
    except (OSError, ValueError) as e:
        raise MiniStreamError(f"{url}/v1/models does not answer ({e})") from None
    if status != 200:
        raise MiniStreamError(f"{url}/v1/models answered HTTP {status}: {str(body)[:200]}")
    names = [card.get("id") for card in body.get("data", []) if isinstance(card, dict)]
    if model is None and names:
        model = names[0]
    if model not in names:
        raise MiniStreamError(f"{url} serves {', '.join(map(str, names)) or 'no model'}, not {model!r}")
    try:
        status, body = complete(url, model, "ready", 1, timeout=timeout)
    except (OSError, ValueError) as e:
        raise MiniStreamError(f"a one-token completion of {model!r} at {url} failed ({e})") from None
    choices = body.get("choices") if isinstance(body, dict) else None
    if status != 200 or not choices:
        raise MiniStreamError(f"a one-token completion of {model!r} answered HTTP {status}: {str(body)[:200]}")
    return str(model)
