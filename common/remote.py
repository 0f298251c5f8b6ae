"""Rewards computed by another process, over HTTP: VLM judges behind an OpenAI-compatible server (`vllm serve`,
SGLang) and any registered reward hosted by `python -m common.rewards serve` (docs/models.md: the schema).

A request that fails (no connection, a timeout, HTTP 429 or 5xx) is retried with exponential backoff; one that
still fails raises RunError naming the URL, so the run stops with one `error:` line and its last checkpoint intact:
a score is never made up. A 4xx answer other than 429 is not retried (the request itself is wrong).
"""

from __future__ import annotations

import base64
import hmac
import io
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
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
    """GET (payload None) or POST JSON to `url`, the answer's JSON. Retries connection errors, timeouts, 429 and 5xx
    `tries` times in all, waiting backoff, 2 backoff, 4 backoff ... seconds; RunError when it still fails."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    why = ""
    for attempt in range(tries):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
            if e.code not in RETRIED:
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        except json.JSONDecodeError as e:
            why = f"the answer is not JSON ({e})"
            break
    raise RunError(
        f"{url} failed after {attempt + 1} tries ({why}); the run stops here, its last checkpoint intact: when the "
        "server answers again, run the same command with --resume-from latest"
    )


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
    found = re.findall(r"Final Score:\s*\**\s*([0-9]+(?:\.[0-9]+)?)", answer)
    return float(found[-1]) if found else None


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
        self.unparsed = torch.zeros(0)

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
        if sum(missing) > self.max_unparsed * len(scores):
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
    and the images as PNG; not differentiable (the images cross a process boundary)."""

    differentiable, video = False, False

    def __init__(self, name: str, url: str, token: str | None = None, timeout: float = 300.0):
        from common.offload import Offloaded

        self.name, self.url, self.token, self.timeout = name, url.rstrip("/"), token, timeout
        self.parts = Offloaded([], "cpu", False)
        served = request_json(f"{self.url}/health", token=token, timeout=10, tries=2).get("rewards", [])
        if name not in served:
            raise InputError(f"--reward-url {name}={url}: that server scores {served}, not {name!r}")

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        payload = {"reward": self.name, "prompts": list(prompts), "images": [{"png": png_base64(x)} for x in images]}
        scores = request_json(f"{self.url}/score", payload, self.token, self.timeout).get("scores")
        if not isinstance(scores, list) or len(scores) != len(images):
            raise RunError(f"{self.url}/score: expected {len(images)} scores, got {str(scores)[:200]}")
        return torch.tensor(scores, dtype=torch.float32, device=images.device)


def decode_images(items: list) -> torch.Tensor:
    """The request's images -> (B, 3, H, W) float in [0, 1]. Each item is {"png": base64} or {"uint8": base64 of
    H*W*3 bytes, "shape": [H, W, 3]}; all of one size. ValueError with the reason otherwise."""
    from PIL import Image

    out = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"images[{k}]: expected an object")
        if "png" in item:
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["png"], validate=True))).convert("RGB"))
        elif "uint8" in item:
            shape = item.get("shape")
            if not (
                isinstance(shape, list)
                and len(shape) == 3
                and shape[2] == 3
                and all(isinstance(s, int) and s > 0 for s in shape)
            ):
                raise ValueError(f"images[{k}]: 'shape' must be [H, W, 3]")
            raw = base64.b64decode(item["uint8"], validate=True)
            if len(raw) != shape[0] * shape[1] * 3:
                raise ValueError(f"images[{k}]: {len(raw)} bytes for shape {shape}")
            pixels = np.frombuffer(raw, np.uint8).reshape(shape)
        else:
            raise ValueError(f"images[{k}]: expected 'png' or 'uint8'")
        out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255)
    if len({tuple(x.shape) for x in out}) > 1:
        raise ValueError("images of different sizes in one request")
    return torch.stack(out)


def serve(
    score: Callable[[str, torch.Tensor, list[str]], torch.Tensor],
    names: list[str],
    host: str,
    port: int,
    token: str | None = None,
    max_batch: int = 64,
    max_mb: float = 64.0,
) -> HTTPServer:
    """An HTTP server (not yet serving: call .serve_forever()) for the rewards `names`, scoring with
    score(name, images, prompts). GET /health -> {"rewards": names}; POST /score {"reward", "prompts", "images"} ->
    {"scores"}. Only that JSON is read (nothing unpickled, no paths); requests over `max_mb` or `max_batch` images, a
    wrong token or a malformed body get a 4xx with the reason, and the server goes on. One request at a time."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if token is None or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                return True
            self._send(401, {"error": "missing or wrong token (Authorization: Bearer TOKEN)"})
            return False

        def do_GET(self):
            if self._authorised():
                self._send(200, {"rewards": names}) if self.path == "/health" else self._send(
                    404, {"error": "no such path"}
                )

        def do_POST(self):
            if not self._authorised():
                return
            if self.path != "/score":
                return self._send(404, {"error": "POST /score"})
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > max_mb * 1e6:
                return self._send(413, {"error": f"the body must have a Content-Length of 1 byte to {max_mb:g} MB"})
            try:
                body = json.loads(self.rfile.read(length))
                name, prompts, items = body["reward"], body["prompts"], body["images"]
                if name not in names:
                    raise ValueError(f"'reward' must be one of {names}")
                if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
                    raise ValueError("'prompts' must be a list of strings")
                if not isinstance(items, list) or len(items) != len(prompts) or not 0 < len(items) <= max_batch:
                    raise ValueError(f"'images' must be a list as long as 'prompts', 1 to {max_batch} items")
                images = decode_images(items)
            except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError and binascii.Error are ValueErrors
                return self._send(400, {"error": f"{type(e).__name__}: {e}"})
            with torch.no_grad():
                scores = score(name, images, prompts)
            self._send(200, {"scores": [float(s) for s in scores]})

        def log_message(self, *a):  # one line per request is noise at training rates
            pass

    return HTTPServer((host, port), Handler)
