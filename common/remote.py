"""Rewards computed by another process, over HTTP: VLM judges behind an OpenAI-compatible server (`vllm serve`,
SGLang) and any registered reward hosted by `python -m common.rewards serve` (docs/models.md: the schema).

A request that fails (no connection, a reset, an answer cut short, a timeout, HTTP 429 or 5xx) is retried with
exponential backoff; one that still fails raises RunError naming the URL, so the run stops with one `error:` line and
its last checkpoint intact: a score is never made up. A 4xx answer other than 429 is not retried (the request itself
is wrong), and neither is an answer that is not what was asked for (not a JSON object; not one finite number per
image), which stops the run at once. The server fails closed too: every request it cannot or will not score gets a
4xx (5xx for a failure of the reward itself) and {"error": reason}, and it goes on serving (serve()).
"""

from __future__ import annotations

import base64
import hmac
import http.client
import io
import json
import math
import re
import struct
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import numpy as np
import torch

from common import InputError, RunError

RETRIED = (429, 500, 502, 503, 504)


def request_json(
    url: str,
    payload: dict | None = None,
    token: str | None = None,
    timeout: float = 120.0,
    tries: int = 5,
    backoff: float = 1.0,
) -> dict:
    """GET (payload None) or POST JSON to `url`, the answer's JSON object. Retries what may pass next time (no
    connection, a reset, an answer cut short, a timeout, HTTP 429 and 5xx) `tries` times in all, waiting backoff,
    2 backoff, 4 backoff ... seconds; RunError when it still fails, and at once for another 4xx or an answer that is
    not a JSON object."""
    data = None if payload is None else json.dumps(payload).encode()
    if token and not token.isprintable():  # a line break would end the header (http.client's error would show it)
        raise RunError(f"{url}: the token ($REWARD_API_KEY) holds a line break or another control character")
    # the token as UTF-8 bytes, as the reward server compares it (http.client would encode a str as Latin-1, and
    # fail on any other character)
    authorization = {"Authorization": b"Bearer " + token.encode()} if token else {}
    try:
        request = urllib.request.Request(url, data, {"Content-Type": "application/json", **authorization})
    except ValueError:  # no scheme at all
        request = None
    if request is None or request.type not in ("http", "https"):  # not worth a retry
        raise RunError(f"{url} is not an http:// or https:// URL")
    why = ""
    for attempt in range(tries):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code}: {_error_body(e)}"
            if e.code not in RETRIED:
                break
            continue
        except ValueError as e:  # http.client refusing the request itself (a URL that is not ASCII, say)
            why = f"{type(e).__name__}: {e}"
            break
        except http.client.HTTPException as e:  # closed before or in the middle of its answer, or garbled: may pass
            why = f"the answer broke off: {e!r}"
            continue
        except OSError as e:  # no connection, a reset, a timeout (URLError among them): may pass
            why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            continue
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past Python's stack
            raise _stopped(url, f"an answer that is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(answer, dict):
            raise _stopped(url, f"JSON that is not an object: {raw[:200].decode(errors='replace')}")
        return answer
    raise RunError(
        f"{url} failed after {attempt + 1} tries ({why}); the run stops here, its last checkpoint intact: when the "
        "server answers again, run the same command with --resume-from latest"
    )


def _stopped(url: str, what: str) -> RunError:
    """The RunError for an answer that no retry would change."""
    return RunError(
        f"{url} answered {what}; the run stops here, its last checkpoint intact: once the server is fixed, run the "
        "same command with --resume-from latest"
    )


def _error_body(error: urllib.error.HTTPError) -> str:
    """The start of an HTTP error's body (the reward server's {"error": reason}), or "" if even that breaks."""
    try:
        return error.read()[:300].decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return ""


def png_base64(image: torch.Tensor) -> str:
    """(3, H, W) float in [0, 1] -> a base64 PNG of its uint8 rounding."""
    from PIL import Image

    pixels = (image.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


# ---------------------------------------------------------------- VLM judges (OpenAI-compatible chat completions)
# UnifiedReward's point-score task (arXiv 2503.05236): the judge rates alignment with the caption and image quality
# and ends its answer with "Final Score: <1-5>"
UNIFIEDREWARD_PROMPT = (
    "You are given a text caption and an image generated from it. Evaluate the image on two criteria: how well it "
    "matches the caption (every object, attribute and relation it names), and its overall quality (clarity, detail, "
    "lack of artifacts). Give an integer score from 1 (poor) to 5 (excellent) and end your answer with a line of "
    'the form "Final Score: <score>".\nCaption: {prompt}'
)
OCR_PROMPT = "Transcribe all the text in this image, exactly as written. Answer with the text alone."


def quoted_text(prompt: str) -> str | None:
    """The text an OCR-prompt asks to render: the first span in double quotes (straight or curly), else None."""
    found = re.search(r'"([^"]+)"|\u201c([^\u201d]+)\u201d', prompt)
    return None if found is None else found.group(1) or found.group(2)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character each)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_score(answer: str, prompt: str) -> float:
    """1 - normalised edit distance between the transcription and the prompt's quoted text, both lowercased and
    without whitespace (Flow-GRPO's OCR reward, arXiv 2505.05470 section 5.1): 1 = exact, 0 = nothing right."""
    target = re.sub(r"\s+", "", (quoted_text(prompt) or "").lower())
    text = re.sub(r"\s+", "", answer.lower())
    return 1.0 - min(edit_distance(text, target), len(target)) / max(1, len(target))


def unifiedreward_score(answer: str, prompt: str) -> float | None:
    """The score of a point-score answer: the number after "Final Score:" (markdown bold allowed), or None when there
    is no such number, when it lies outside the asked 1..5, or when the answer gives several that differ. An answer
    that scores twice (a judge revising itself, or quoting an example score) is ambiguous: taking the first or the
    last would train on a score the judge may not have meant, so it counts as unparsed (asked once more, then logged,
    and bounded by the Judge's max_unparsed) instead of being guessed."""
    found = {float(s) for s in re.findall(r"Final Score:\s*\**\s*([0-9]+(?:\.[0-9]+)?)", answer)}
    if len(found) != 1:
        return None
    score = found.pop()
    return score if 1 <= score <= 5 else None


JUDGES: dict[str, tuple[str, Callable[[str, str], float | None]]] = {
    "unifiedreward": (UNIFIEDREWARD_PROMPT, unifiedreward_score),
    "ocr": (OCR_PROMPT, ocr_score),
}


class Judge:
    """A reward read from a VLM's answers: one chat completion per image (temperature 0), `concurrency` at a time.
    An answer that does not parse is asked once more; if it still does not, the image gets the mean of the batch's
    parsed scores (no advantage either way), is counted in `unparsed` (logged as rewards/<name>_unparsed) and, past
    `max_unparsed` of a batch, stops the run with RunError."""

    differentiable, video = False, False

    def __init__(
        self,
        name: str,
        url: str,
        token: str | None = None,
        concurrency: int = 16,
        timeout: float = 120.0,
        max_unparsed: float = 0.1,
    ):
        from common.offload import Offloaded

        self.name, self.base, self.token = name, url.rstrip("/"), token
        self.template, self.parse = JUDGES[name]
        self.concurrency, self.timeout, self.max_unparsed = concurrency, timeout, max_unparsed
        self.parts = Offloaded([], "cpu", False)
        models = request_json(f"{self.base}/models", token=token, timeout=10, tries=2).get("data") or [{}]
        self.model = models[0].get("id")  # what `vllm serve MODEL` serves
        if not self.model:
            raise InputError(f"--reward-url {name}={url}: {self.base}/models lists no model")
        self.unparsed = torch.zeros(0)  # cpu: a placeholder; every call replaces it with flags on the images' device

    def _ask(self, image_b64: str, prompt: str) -> str:
        text = self.template.format(prompt=prompt) if "{prompt}" in self.template else self.template
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image_b64}"}},
            {"type": "text", "text": text},
        ]
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.0,
            "max_tokens": 512,
        }
        answer = request_json(f"{self.base}/chat/completions", payload, self.token, self.timeout)
        try:
            return answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RunError(f"{self.base}/chat/completions: not a chat completion: {str(answer)[:300]}") from None

    def _score_one(self, image_b64: str, prompt: str) -> float | None:
        for _ in range(2):
            score = self.parse(self._ask(image_b64, prompt), prompt)
            if score is not None:
                return score
        return None

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        encoded = [png_base64(x) for x in images]
        with ThreadPoolExecutor(self.concurrency) as pool:
            scores = list(pool.map(self._score_one, encoded, prompts))
        missing = [s is None for s in scores]
        self.unparsed = torch.tensor(missing, dtype=torch.float32, device=images.device)
        # the share against the limit, not the count against limit x n: 0.29 x 100 rounds to 28.999999999999996
        if scores and sum(missing) / len(scores) > self.max_unparsed:
            raise RunError(
                f"{self.name} at {self.base}: {sum(missing)} of {len(scores)} answers had no score that parses, more "
                f"than {self.max_unparsed:.0%}; check that the server runs the judge this reward expects"
            )
        parsed = [s for s in scores if s is not None]
        fill = sum(parsed) / len(parsed) if parsed else 0.0
        return torch.tensor([fill if s is None else s for s in scores], dtype=torch.float32, device=images.device)


# ---------------------------------------------------------------- any reward, hosted by `python -m common.rewards serve`
class Served:
    """A registered reward scored by a `python -m common.rewards serve` process: POST {url}/score with the prompts
    and the images as PNG; not differentiable (the images cross a process boundary). An answer that is not one finite
    number per image stops the run (RunError naming the URL and the first thing wrong)."""

    differentiable, video = False, False

    def __init__(self, name: str, url: str, token: str | None = None, timeout: float = 300.0):
        from common.offload import Offloaded

        self.name, self.url, self.token, self.timeout = name, url.rstrip("/"), token, timeout
        self.parts = Offloaded([], "cpu", False)
        answer = request_json(f"{self.url}/health", token=token, timeout=10, tries=2)
        served = answer.get("rewards")
        if not (isinstance(served, list) and all(isinstance(n, str) for n in served)):
            raise InputError(
                f"--reward-url {name}={url}: {self.url}/health answered {json.dumps(answer)[:200]}, not a reward "
                'server\'s {"rewards": [names]} (is it `python -m common.rewards serve`?)'
            )
        if name not in served:
            raise InputError(f"--reward-url {name}={url}: that server scores {served}, not {name!r}")

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        payload = {"reward": self.name, "prompts": list(prompts), "images": [{"png": png_base64(x)} for x in images]}
        scores = request_json(f"{self.url}/score", payload, self.token, self.timeout).get("scores")
        wrong = _wrong_scores(scores, len(images))
        if wrong:
            raise _stopped(f"{self.url}/score", wrong)
        return torch.tensor(scores, dtype=torch.float32, device=images.device)


def _wrong_scores(scores, n: int) -> str | None:
    """What is wrong with an answer's "scores" for n images (a flat list of n numbers, finite as float32), or
    None."""
    if not isinstance(scores, list):
        return f"no list of scores ('scores': {json.dumps(scores)[:200]})"
    if len(scores) != n:
        return f"{len(scores)} scores for {n} images"
    for k, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)):  # JSON true is a Python int
            return f"scores[{k}] is {json.dumps(s)[:100]}, not a number"
        # json.loads reads NaN, Infinity and 1e999 (inf) as floats, and 1e300 would be inf as float32; NaN compares
        # False, and an int of any size compares exactly
        if not abs(s) <= torch.finfo(torch.float32).max:
            return f"scores[{k}] is {str(s)[:50]}, not a finite number (as float32)"
    return None


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _TooManyPixels(ValueError):
    """decode_images' refusal of an image, or of a request, over the pixel cap (HTTP 413, not 400)."""


def _png_size(data: bytes, k: int) -> tuple[int, int]:
    """(H, W) from a PNG's IHDR chunk (width and height at bytes 16..24), read before any pixel is decoded."""
    if not data.startswith(_PNG_MAGIC):
        found = "a JPEG" if data.startswith(b"\xff\xd8\xff") else f"bytes starting {data[:8].hex(' ') or 'nowhere'}"
        raise ValueError(f"images[{k}]: 'png' holds {found}, not a PNG")
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError(f"images[{k}]: a PNG without its IHDR header (cut short?)")
    width, height = struct.unpack(">II", data[16:24])
    if not (width and height):
        raise ValueError(f"images[{k}]: a PNG of {width}x{height} pixels")
    return height, width


def _base64(item: dict, key: str, k: int) -> bytes:
    try:
        return base64.b64decode(item[key], validate=True)
    except (TypeError, ValueError) as e:  # not a str; binascii.Error is a ValueError
        raise ValueError(f"images[{k}]: '{key}' is not base64 ({type(e).__name__}: {e})") from None


def decode_images(items: list, max_pixels: int | None = None) -> torch.Tensor:
    """The request's images -> (B, 3, H, W) float in [0, 1]. Each item is {"png": base64 of a PNG file} or
    {"uint8": base64 of H*W*3 bytes, "shape": [H, W, 3]}; all of one size. ValueError with the reason otherwise.
    Every size is read first (a PNG's header, a "shape") and checked against `max_pixels`, for each image and for
    all together, before a pixel is decoded: a 79 KB PNG can unpack to 9000x9000 pixels (a 2 GB tensor here). Over
    the cap: _TooManyPixels, a ValueError."""
    from PIL import Image

    found = []  # (bytes, (H, W), is it a PNG) per item
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"images[{k}]: expected an object")
        if "png" in item:
            data = _base64(item, "png", k)
            found.append((data, _png_size(data, k), True))
        elif "uint8" in item:
            shape = item.get("shape")
            if not (
                isinstance(shape, list)
                and len(shape) == 3
                and shape[2] == 3
                and all(isinstance(s, int) and s > 0 for s in shape)
            ):
                raise ValueError(f"images[{k}]: 'shape' must be [H, W, 3]")
            data = _base64(item, "uint8", k)
            if len(data) != shape[0] * shape[1] * 3:
                raise ValueError(f"images[{k}]: {len(data)} bytes for shape {shape}")
            found.append((data, (shape[0], shape[1]), False))
        else:
            raise ValueError(f"images[{k}]: expected 'png' or 'uint8'")
    if max_pixels is not None:
        for k, (_, (h, w), _) in enumerate(found):
            if h * w > max_pixels:
                raise _TooManyPixels(f"images[{k}] is {w}x{h}, more than {max_pixels:,} pixels (--max-pixels)")
        total = sum(h * w for _, (h, w), _ in found)
        if total > max_pixels:
            raise _TooManyPixels(f"{total:,} pixels in all, more than {max_pixels:,} a request (--max-pixels)")
    if len({size for _, size, _ in found}) > 1:
        raise ValueError("images of different sizes in one request")
    out = []
    for k, (data, (h, w), png) in enumerate(found):
        if png:
            try:
                with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
                    pixels = np.asarray(image.convert("RGB"))
            except Image.DecompressionBombError as e:  # PIL's own cap (Image.MAX_IMAGE_PIXELS), should ours be higher
                raise _TooManyPixels(f"images[{k}]: {e}") from None
            except Exception as e:  # a broken file comes out of PIL as OSError, SyntaxError, zlib.error, EOFError...
                raise ValueError(f"images[{k}]: not a readable PNG ({type(e).__name__}: {e})") from None
        else:
            pixels = np.frombuffer(data, np.uint8).reshape(h, w, 3)
        out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255)
    return torch.stack(out)


class _Failed(Exception):
    """A /score or /health request answered with HTTP `code` and {"error": reason} instead of scores."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection: a client that stalls holds its own thread until its read timeout, no one
    else's, and never keeps the process from exiting."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        # a client gone before its answer (a reset, a broken pipe) is its own affair; anything else is a bug here
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def serve(
    score: Callable[[str, torch.Tensor, list[str]], torch.Tensor],
    names: list[str],
    host: str,
    port: int,
    token: str | None = None,
    max_batch: int = 64,
    max_mb: float = 64.0,
    max_pixels: int = 2**25,
    read_timeout: float = 10.0,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving: call .serve_forever()) for the rewards `names`, scoring with
    score(name, images, prompts). GET /health -> {"rewards": names}; POST /score {"reward", "prompts", "images"} ->
    {"scores"}. Only that JSON is read (nothing unpickled, no paths). Each connection is read on its own thread, each
    read waiting at most `read_timeout` seconds, so that a client that stalls is dropped and delays no one; scoring
    is one request at a time (one model on one device).

    Anything else is answered {"error": reason}, and the server goes on: 400 a malformed request (Content-Length,
    JSON, fields, an image that is not a readable PNG or does not fit its shape), 401 a missing or wrong token, 404
    another path, 408 a body that stops arriving, 411 no Content-Length, 413 a body over `max_mb` or images over
    `max_pixels` (each image, and all of a request together; read from the PNG headers, before decoding), 415 a body
    that is not application/json, 422 the reward's own refusal (a ValueError, e.g. the verifier given a prompt that
    is not ShapesBench's), 500 any other failure of the reward (its type and first line; its traceback on stderr)."""
    scoring = threading.Lock()
    max_bytes = int(max_mb * 1e6)
    expected = None if token is None else token.encode()  # compared as bytes: the client sends it UTF-8 encoded

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout  # the connection's socket timeout (StreamRequestHandler.setup)

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code, message=None, explain=None):
            # http.server's own refusals (a malformed request line or header, another method): JSON as well
            self._send(code, {"error": message or self.responses.get(code, ("refused",))[0]})

        def _answer(self, handle: Callable[[], dict]) -> None:
            """200 and handle()'s answer, or the _Failed code and reason. After a refusal, the body left unread
            (up to twice the cap) is read and dropped, so that a client still sending it reads the answer instead
            of a reset connection; beyond that the connection is closed under it."""
            values = self.headers.get_all("Content-Length") or []
            framed = len(values) == 1 and re.fullmatch(r"[0-9]{1,15}", values[0].strip()) is not None
            self.unread = int(values[0]) if framed and "Transfer-Encoding" not in self.headers else None
            try:
                self._send(200, handle())
            except _Failed as e:
                self._send(e.code, {"error": e.reason})
                left = self.unread or 0
                if left <= 2 * max_bytes:
                    try:
                        while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
                            left -= len(chunk)
                    except OSError:  # the client went, or stalled past the timeout: the connection closes anyway
                        pass

        def _check_token(self) -> None:
            if expected is None:
                return
            scheme, _, credentials = self.headers.get("Authorization", "").strip().partition(" ")
            # http.server decodes header bytes as Latin-1, so encoding back gives the bytes sent (never a "?": no
            # character there is past U+00FF); compared in constant time
            sent = credentials.strip().encode("latin-1", errors="replace")
            if scheme.lower() != "bearer" or not hmac.compare_digest(sent, expected):
                raise _Failed(401, "missing or wrong token (Authorization: Bearer TOKEN)")

        def _health(self) -> dict:
            self._check_token()
            if self.path != "/health":
                raise _Failed(404, "GET /health or POST /score")
            return {"rewards": names}

        def _read_body(self) -> bytes:
            if "Transfer-Encoding" in self.headers or not self.headers.get_all("Content-Length"):
                raise _Failed(411, "the body needs a Content-Length (and no Transfer-Encoding)")
            if self.unread is None:
                shown = ", ".join(self.headers.get_all("Content-Length"))[:40]
                raise _Failed(400, f"Content-Length must be one number of bytes, not {shown!r}")
            length = self.unread
            if length == 0:
                raise _Failed(400, "an empty body")
            if length > max_bytes:
                raise _Failed(413, f"the body must have a Content-Length of 1 byte to {max_mb:g} MB, not {length:,}")
            if self.headers.get_content_type() != "application/json":  # parameters (charset=utf-8) are allowed
                given = self.headers.get("Content-Type", "none")
                raise _Failed(415, f"Content-Type must be application/json, not {given!r}")
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                self.unread = None  # the socket reads no more after a timeout
                raise _Failed(408, f"the body stopped arriving for {read_timeout:g} s") from None
            if len(body) < length:
                self.unread = None
                raise _Failed(400, f"the body ended after {len(body):,} of its {length:,} bytes")
            self.unread = 0
            return body

        def _score(self) -> dict:
            self._check_token()
            if self.path != "/score":
                raise _Failed(404, "POST /score or GET /health")
            raw = self._read_body()
            try:
                body = json.loads(raw)
            except RecursionError:
                raise _Failed(400, "JSON nested too deep") from None
            except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
                raise _Failed(400, f"{type(e).__name__}: {e}") from None
            if not isinstance(body, dict) or not {"reward", "prompts", "images"} <= body.keys():
                raise _Failed(400, 'the body must be a JSON object with "reward", "prompts" and "images"')
            name, prompts, items = body["reward"], body["prompts"], body["images"]
            if name not in names:
                raise _Failed(400, f"'reward' must be one of {names}")
            if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
                raise _Failed(400, "'prompts' must be a list of strings")
            if not isinstance(items, list) or len(items) != len(prompts) or not 0 < len(items) <= max_batch:
                raise _Failed(400, f"'images' must be a list as long as 'prompts', 1 to {max_batch} items")
            try:
                images = decode_images(items, max_pixels)
            except _TooManyPixels as e:
                raise _Failed(413, str(e)) from None
            except ValueError as e:
                raise _Failed(400, f"{type(e).__name__}: {e}") from None
            try:
                with scoring, torch.no_grad():
                    scores = [float(s) for s in score(name, images, prompts)]
            except ValueError as e:  # the reward refuses these inputs: the client's to fix
                raise _Failed(422, f"{name}: {type(e).__name__}: {e}") from None
            except Exception as e:  # a failure of the reward here; the client may retry, the operator has the trace
                traceback.print_exc()
                first = (str(e).splitlines() or [""])[0][:300]
                raise _Failed(500, f"{name}: {type(e).__name__}: {first}") from None
            if len(scores) != len(images) or not all(map(math.isfinite, scores)):
                raise _Failed(500, f"{name} returned {str(scores)[:200]} for {len(images)} images")
            return {"scores": scores}

        def do_GET(self):
            self._answer(self._health)

        def do_POST(self):
            self._answer(self._score)

        def log_message(self, *a):  # one line per request is noise at training rates
            pass

    return _Server((host, port), Handler)
