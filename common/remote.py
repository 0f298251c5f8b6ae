"""Rewards computed by another process, over HTTP: VLM judges behind an OpenAI-compatible server (`vllm serve`,
SGLang) and any registered reward hosted by `python -m common.rewards serve` (docs/models.md: the schema).

Each try has a deadline for all of it (connect, send, the whole answer). A request that fails (no connection, a
reset, an answer cut short, a try past its deadline, HTTP 429 or 5xx) is retried with exponential backoff; one that
still fails raises RunError naming the URL, so the run stops with one `error:` line and its last checkpoint intact: a
score is never made up. A redirect is never followed (the token goes to the URL given alone), and neither it, nor a
4xx answer other than 429 (the request itself is wrong), nor an answer that is not what was asked for (not a JSON
object; not one finite number per image) is retried: the run stops at once. The server fails closed too: every
request it cannot or will not score gets a 4xx (5xx for a failure of the reward itself) and {"error": reason}, each
request must arrive whole by its deadline, and its memory is bounded by its caps; it goes on serving (serve()).
"""

from __future__ import annotations

import base64
import hmac
import http.client
import io
import json
import math
import re
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import numpy as np
import torch
from PIL import Image

from common import InputError, RunError
from common.offload import Offloaded

RETRIED = (429, 500, 502, 503, 504)
# the longest wait a server's Retry-After (in seconds) is granted before a retry: a server that asks for more is
# asked again sooner, so that a call still ends in bounded time
MAX_RETRY_AFTER = 30.0
MAX_ANSWER = 64 * 2**20  # bytes of an answer, at most (a reward server's scores or a judge's completion: far less)
# what a training run does after a served reward fails (common.evaluate says its own: it takes no --resume-from)
STOPS = "the run stops here, its last checkpoint intact"
RESUME = f"{STOPS}: once the server answers well, run the same command with --resume-from latest"


def _exchange(url: str, data: bytes | None, headers: dict, timeout: float) -> tuple[int, str, str, bytes]:
    """One HTTP request to `url` (POST `data`, or GET): (status, Location header, Retry-After header, body). Every
    phase (connect,
    send, the answer's head and body) within `timeout` seconds of the start, all together: a timer shuts the socket
    down at the deadline, so that an answer trickling in a byte at a time is cut off too (TimeoutError). Redirects
    are answers like any other (http.client follows none); a body over MAX_ANSWER bytes is a ValueError."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    expired, opened = threading.Event(), []

    def expire():
        expired.set()  # before reading `opened`: either this sees the socket, or the caller sees the flag
        for sock in opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        connection.connect()
        # the socket itself, kept here: an answer that closes its connection (HTTP/1.0, Connection: close) takes it
        # over, and http.client then sets connection.sock to None while the body is still being read from it
        opened.append(connection.sock)
        if expired.is_set():
            raise TimeoutError
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request("GET" if data is None else "POST", target, data, headers)
        answer = connection.getresponse()
        if answer.length is not None and answer.length > MAX_ANSWER:  # its Content-Length
            raise ValueError(f"an answer of {answer.length:,} bytes, more than {MAX_ANSWER:,}")
        # read() whole: IncompleteRead if it ends short of its Content-Length; else (chunked, or up to the close) at
        # most one byte past the cap
        body = answer.read() if answer.length is not None else answer.read(MAX_ANSWER + 1)
        if expired.is_set():  # a body without a Content-Length ends where the socket was shut
            raise TimeoutError
        if len(body) > MAX_ANSWER:
            raise ValueError(f"an answer of more than {MAX_ANSWER:,} bytes")
        return answer.status, answer.getheader("Location", ""), answer.getheader("Retry-After", ""), body
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise TimeoutError(f"no whole answer within {timeout:g} s (the deadline of one try)") from None
        raise
    finally:
        timer.cancel()
        connection.close()


def request_json(
    url: str,
    payload: dict | None = None,
    token: str | None = None,
    timeout: float = 120.0,
    tries: int = 5,
    backoff: float = 1.0,
) -> dict:
    """GET (payload None) or POST JSON to `url`, the answer's JSON object. Each try must end within `timeout`
    seconds, all of it (connect, send, the whole answer), so one call lasts at most tries x timeout plus the
    backoff waits. Retries what may pass next time (no connection, a reset, an answer cut short, a try past its
    deadline, HTTP 429 and 5xx) `tries` times in all, waiting backoff, 2 backoff, 4 backoff ... seconds
    (longer where a 429 or 503 asks for it with Retry-After, up to MAX_RETRY_AFTER); RunError
    when it still fails, and at once for a redirect (never followed: the token goes to `url` alone), another 4xx or
    an answer that is not a JSON object."""
    data = None if payload is None else json.dumps(payload).encode()
    if token and not token.isprintable():  # a line break would end the header (http.client's error would show it)
        raise RunError(f"{url}: the token ($REWARD_API_KEY) holds a line break or another control character")
    # the token as UTF-8 bytes, as the reward server compares it (http.client would encode a str as Latin-1, and
    # fail on any other character)
    headers = {"Content-Type": "application/json"} | ({"Authorization": b"Bearer " + token.encode()} if token else {})
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0 and url.isascii()
    except ValueError:  # a port that is not a number
        ok = False
    if not ok or any(c.isspace() or not c.isprintable() for c in url):  # not worth a retry
        raise RunError(f"{url} is not an http:// or https:// URL (ASCII, with a host)")
    why, asked = "", 0.0
    for attempt in range(tries):
        if attempt:
            time.sleep(max(backoff * 2 ** (attempt - 1), asked))
        asked = 0.0
        try:
            status, location, retry_after, raw = _exchange(url, data, headers, timeout)
        except TimeoutError as e:  # may pass
            why = str(e) or f"TimeoutError after {timeout:g} s"
            continue
        except http.client.HTTPException as e:  # closed before or in the middle of its answer, or garbled: may pass
            why = f"the answer broke off: {e!r}"
            continue
        except OSError as e:  # no connection, a reset: may pass
            why = f"{type(e).__name__}: {e}"
            continue
        except ValueError as e:  # an answer over MAX_ANSWER
            raise _stopped(url, str(e)) from None
        if 300 <= status < 400:
            raise _stopped(
                url,
                f"HTTP {status}, a redirect to {location[:200]!r}, which is not followed (nor sent the token): give "
                "--reward-url the address that answers itself",
            )
        if status >= 400:
            why = f"HTTP {status}: {raw[:300].decode(errors='replace')}"
            if status not in RETRIED:
                break
            # a busy server says when to come back (delta-seconds; an HTTP date is ignored): heeded, bounded
            if status in (429, 503) and re.fullmatch(r"[0-9]{1,9}", retry_after.strip()):
                asked = min(float(retry_after), MAX_RETRY_AFTER)
            continue
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past Python's stack
            raise _stopped(url, f"an answer that is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(answer, dict):
            raise _stopped(url, f"JSON that is not an object: {raw[:200].decode(errors='replace')}")
        return answer
    raise RunError(f"{url} failed after {attempt + 1} tries ({why}); {RESUME}")


def _stopped(url: str, what: str) -> RunError:
    """The RunError for an answer that no retry would change."""
    return RunError(f"{url} answered {what}; {RESUME}")


def png_base64(image: torch.Tensor) -> str:
    """(3, H, W) float in [0, 1] -> a base64 PNG of its uint8 rounding."""
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


# An edit judge in VIEScore's form (arXiv 2312.14867, section 3), the rule EditScore and the edit rewards of the
# frameworks follow: semantic consistency from the source and the edit (did the edit do what the instruction says;
# did it leave the rest alone), perceptual quality from the edit alone (natural; free of artifacts), each criterion
# 0-10 in a JSON answer, the overall score sqrt(min(consistency) * min(quality)) / 10 in [0, 1]. Our own wording.
EDIT_CONSISTENCY_PROMPT = (
    "You are shown two images: the first is a source image, the second is the result of editing it with the "
    "instruction below. Rate two things from 0 to 10. First, how fully the edit carries out the instruction (0: not at "
    "all, 10: exactly). Second, how well the edit keeps everything the instruction does not ask to change (0: the "
    "image is replaced or changed beyond the request, 10: only what was asked changed). Answer with one JSON object "
    'and nothing else, of the form {{"score": [<first>, <second>], "reasoning": "<one sentence>"}}.\n'
    "Instruction: {prompt}"
)
EDIT_QUALITY_PROMPT = (
    "Rate this image on two things from 0 to 10. First, how natural it looks (lighting, shadows, proportions, a "
    "plausible scene). Second, how free it is of artifacts (distortions, blur, noise, broken objects or text). Answer "
    'with one JSON object and nothing else, of the form {"score": [<first>, <second>], "reasoning": "<one sentence>"}.'
)


def judge_scores(answer: str, n: int) -> list[float] | None:
    """The n scores of a JSON answer {"score": [s1, ..., sn], ...}, each in 0..10, or None: no such object, another
    count, a score out of range or not a number, or several objects that disagree (as unifiedreward_score, an answer
    that scores twice is not guessed). A ```json fence around the object is allowed."""
    found, decoder = set(), json.JSONDecoder()
    for start in (i for i, c in enumerate(answer) if c == "{"):
        try:
            obj = decoder.raw_decode(answer, start)[0]
        except json.JSONDecodeError:
            continue
        scores = obj.get("score") if isinstance(obj, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            continue
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10 for x in scores):
            return None
        found.add(tuple(float(x) for x in scores))
    return list(found.pop()) if len(found) == 1 else None


JUDGES: dict[str, tuple[str, Callable[[str, str], float | None]]] = {
    "unifiedreward": (UNIFIEDREWARD_PROMPT, unifiedreward_score),
    "ocr_judge": (OCR_PROMPT, ocr_score),
    # the consistency half; EditJudge asks the quality half too
    "edit_judge": (EDIT_CONSISTENCY_PROMPT, lambda answer, prompt: judge_scores(answer, 2)),
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
        self.name, self.base, self.token = name, url.rstrip("/"), token
        self.template, self.parse = JUDGES[name]
        self.concurrency, self.timeout, self.max_unparsed = concurrency, timeout, max_unparsed
        self.parts = Offloaded([], "cpu", False)
        models = request_json(f"{self.base}/models", token=token, timeout=10, tries=2).get("data") or [{}]
        self.model = models[0].get("id")  # what `vllm serve MODEL` serves
        if not self.model:
            raise InputError(f"--reward-url {name}={url}: {self.base}/models lists no model")
        self.unparsed = torch.zeros(0)  # cpu: a placeholder; every call replaces it with flags on the images' device

    def _ask(self, image_b64: str | list[str], prompt: str, template: str | None = None) -> str:
        """The judge's answer on the images (one, or several in order) and the template (this judge's by default)."""
        template = self.template if template is None else template
        text = template.format(prompt=prompt) if "{prompt}" in template else template
        images = [image_b64] if isinstance(image_b64, str) else image_b64
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}} for b64 in images]
        content.append({"type": "text", "text": text})
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
        return self._tally(scores, images.device)

    def _tally(self, scores: list[float | None], device) -> torch.Tensor:
        """The scores as a tensor, an unparsed one (None) filled with the mean of the parsed ones and counted."""
        missing = [s is None for s in scores]
        self.unparsed = torch.tensor(missing, dtype=torch.float32, device=device)
        # the share against the limit, not the count against limit x n: 0.29 x 100 rounds to 28.999999999999996
        if scores and sum(missing) / len(scores) > self.max_unparsed:
            raise RunError(
                f"{self.name} at {self.base}: {sum(missing)} of {len(scores)} answers had no score that parses, more "
                f"than {self.max_unparsed:.0%}; check that the server runs the judge this reward expects"
            )
        parsed = [s for s in scores if s is not None]
        fill = sum(parsed) / len(parsed) if parsed else 0.0
        return torch.tensor([fill if s is None else s for s in scores], dtype=torch.float32, device=device)


class EditJudge(Judge):
    """An edit judged by a VLM from its source (EDIT_CONSISTENCY_PROMPT: the source, then the edit, and the
    instruction) and from itself (EDIT_QUALITY_PROMPT): sqrt(min(consistency) * min(quality)) / 10 in [0, 1], VIEScore's
    overall score. `sources(prompts, height, width)` gives the sources (B, 3, H, W) in [0, 1], cut to the edits' frame
    (the caller's: common.rewards.source_pixels). Each of the two answers is asked at most twice; an image whose
    answers do not both parse is unparsed, as Judge's."""

    def __init__(self, name: str, url: str, sources: Callable, token: str | None = None, **kw):
        super().__init__(name, url, token, **kw)
        self.sources = sources

    def _ask_scores(self, images_b64, prompt: str, template: str) -> list[float] | None:
        for _ in range(2):
            scores = judge_scores(self._ask(images_b64, prompt, template), 2)
            if scores is not None:
                return scores
        return None

    def _score_pair(self, source_b64: str, edit_b64: str, prompt: str) -> float | None:
        consistency = self._ask_scores([source_b64, edit_b64], prompt, self.template)
        quality = None if consistency is None else self._ask_scores(edit_b64, prompt, EDIT_QUALITY_PROMPT)
        return None if quality is None else math.sqrt(min(consistency) * min(quality)) / 10

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        sources = [png_base64(x) for x in self.sources(prompts, *images.shape[-2:])]
        edits = [png_base64(x) for x in images]
        with ThreadPoolExecutor(self.concurrency) as pool:
            return self._tally(
                list(pool.map(self._score_pair, sources, edits, [str(p) for p in prompts])), images.device
            )


# ---------------------------------------------------------------- any reward, hosted by `python -m common.rewards serve`
class Served:
    """A registered reward scored by a `python -m common.rewards serve` process: POST {url}/score with the prompts
    and the images as PNG; not differentiable (the images cross a process boundary). An answer that is not one finite
    number per image stops the run (RunError naming the URL and the first thing wrong)."""

    differentiable, video = False, False

    def __init__(self, name: str, url: str, token: str | None = None, timeout: float = 300.0):
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


def _base64(item: dict, key: str, k: int) -> bytes:
    try:
        return base64.b64decode(item[key], validate=True)
    except (TypeError, ValueError) as e:  # not a str; binascii.Error is a ValueError
        raise ValueError(f"images[{k}]: '{key}' is not base64 ({type(e).__name__}: {e})") from None


def _open_png(data: bytes, k: int):
    """The PIL image of a PNG file, its chunks read up to the pixels and none of them decoded: its size is the one
    the decoder will decode (the last IHDR chunk, should a file hold two)."""
    if not data.startswith(_PNG_MAGIC):
        found = "a JPEG" if data.startswith(b"\xff\xd8\xff") else f"bytes starting {data[:8].hex(' ') or 'nowhere'}"
        raise ValueError(f"images[{k}]: 'png' holds {found}, not a PNG")
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG"])
    except Image.DecompressionBombError as e:  # PIL's own cap (Image.MAX_IMAGE_PIXELS), should ours be higher
        raise _TooManyPixels(f"images[{k}]: {e}") from None
    except Exception as e:  # a broken file comes out of PIL as OSError, SyntaxError, zlib.error, EOFError...
        raise ValueError(f"images[{k}]: not a readable PNG ({type(e).__name__}: {e})") from None
    if getattr(image, "is_animated", False):
        raise ValueError(f"images[{k}]: an animated PNG (one frame per image)")
    return image


def decode_images(items: list, max_pixels: int | None = None) -> torch.Tensor:
    """The request's images -> (B, 3, H, W) float in [0, 1]. Each item is {"png": base64 of a PNG file} or
    {"uint8": base64 of H*W*3 bytes, "shape": [H, W, 3]}; all of one size. ValueError with the reason otherwise.
    Every size is read first (a PNG's header as PIL's decoder reads it, a "shape") and checked against
    `max_pixels`, for each image and for all together, before a pixel is decoded: a 300-byte PNG can unpack to
    9000x9000 pixels (a 1 GB tensor here). Over the cap: _TooManyPixels, a ValueError. Memory while decoding: the
    (B, 3, H, W) float32 result (12 bytes a pixel) and one image being decoded (at most 11 bytes a pixel: PIL's
    4-byte pixels, their RGB conversion and the uint8 array), so at most 23 bytes times `max_pixels`."""
    found = []  # (the opened PNG, or the raw bytes; (H, W)) per item
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"images[{k}]: expected an object")
        if "png" in item:
            image = _open_png(_base64(item, "png", k), k)
            found.append((image, (image.height, image.width)))
        elif "uint8" in item:
            shape = item.get("shape")
            if not (isinstance(shape, list) and len(shape) == 3 and all(type(s) is int and s > 0 for s in shape)
                    and shape[2] == 3):  # fmt: skip  # type(): JSON true is a Python int, and no size
                raise ValueError(f"images[{k}]: 'shape' must be [H, W, 3] of positive integers, not {str(shape)[:60]}")
            data = _base64(item, "uint8", k)
            if len(data) != shape[0] * shape[1] * 3:
                raise ValueError(f"images[{k}]: {len(data)} bytes for shape {shape}")
            found.append((data, (shape[0], shape[1])))
        else:
            raise ValueError(f"images[{k}]: expected 'png' or 'uint8'")
    if max_pixels is not None:
        for k, (_, (h, w)) in enumerate(found):
            if h * w > max_pixels:
                raise _TooManyPixels(f"images[{k}] is {w}x{h}, more than {max_pixels:,} pixels (--max-pixels)")
        total = sum(h * w for _, (h, w) in found)
        if total > max_pixels:
            raise _TooManyPixels(f"{total:,} pixels in all, more than {max_pixels:,} a request (--max-pixels)")
    if len({size for _, size in found}) != 1:
        raise ValueError("images of different sizes in one request" if found else "no images")
    h, w = found[0][1]
    out = torch.empty(len(found), 3, h, w)  # cpu: decoded here; the caller moves them to the reward's device
    for k, (source, _) in enumerate(found):
        if isinstance(source, bytes):
            pixels = np.frombuffer(source, np.uint8).reshape(h, w, 3).copy()
        else:
            try:
                with source:
                    pixels = np.array(source.convert("RGB"))
            except Exception as e:  # a broken file comes out of PIL as OSError, SyntaxError, zlib.error, EOFError...
                raise ValueError(f"images[{k}]: not a readable PNG ({type(e).__name__}: {e})") from None
        if pixels.shape != (h, w, 3):  # what was decoded is what was counted, or nothing is scored
            raise ValueError(f"images[{k}]: decoded to {pixels.shape}, not the {w}x{h} of its header")
        out[k] = torch.from_numpy(pixels).permute(2, 0, 1)
    return out.div_(255)


class _Failed(Exception):
    """A /score or /health request answered with HTTP `code` and {"error": reason} instead of scores."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def parse_request(raw: bytes, names: list[str], max_batch: int, max_pixels: int, max_prompt_chars: int):
    """A /score body -> (reward name, prompts, images (B, 3, H, W)), or _Failed with a 4xx and the reason; nothing
    else escapes for any bytes. JSON values are counted before the body is parsed (a 64 MB body of `[{},{},...]`
    would be 1.4 GB of Python objects): at most as many as a request of `max_batch` images of `max_prompt_chars`
    characters can hold."""
    bound = 64 + 8 * max_batch + max_batch * max_prompt_chars  # separators: each JSON value but one follows one
    count = raw.count(b",") + raw.count(b":")
    if count > bound:
        raise _Failed(400, f"the body holds {count:,} JSON separators, more than a request can need ({bound:,})")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _Failed(400, "JSON nested too deep") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise _Failed(400, f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(body, dict) or not {"reward", "prompts", "images"} <= body.keys():
        raise _Failed(400, 'the body must be a JSON object with "reward", "prompts" and "images"')
    name, prompts, items = body["reward"], body["prompts"], body["images"]
    if not isinstance(name, str) or name not in names:
        raise _Failed(400, f"'reward' must be one of {names}")
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
        raise _Failed(400, "'prompts' must be a list of strings")
    if not isinstance(items, list) or len(items) != len(prompts) or not 0 < len(items) <= max_batch:
        raise _Failed(400, f"'images' must be a list as long as 'prompts', 1 to {max_batch} items")
    for k, p in enumerate(prompts):
        if len(p) > max_prompt_chars:
            raise _Failed(
                413, f"prompts[{k}] has {len(p):,} characters, more than {max_prompt_chars:,} (--max-prompt-chars)"
            )
        try:
            p.encode()
        except UnicodeEncodeError as e:  # a lone surrogate (JSON's "\ud800") is no text a tokenizer reads
            raise _Failed(400, f"prompts[{k}] is not text: {e.reason} at character {e.start}") from None
    try:
        images = decode_images(items, max_pixels)
    except _TooManyPixels as e:
        raise _Failed(413, str(e)) from None
    except (ValueError, TypeError, OverflowError) as e:
        raise _Failed(400, f"{type(e).__name__}: {e}") from None
    return name, prompts, images


HEADER_BYTES = 2**17  # bytes read of a connection before its headers have ended, at most
OPEN_PER_TURN = 16  # connections open at once (sending headers, or waiting their turn) per --max-connections


class _DeadlineReader(io.RawIOBase):
    """A connection's socket, read under a deadline (time.monotonic()): each read waits at most `read_timeout`
    seconds and none waits past the deadline, so that a request trickling in a byte at a time is cut off too. Until
    headers_in() is called the deadline is `header_seconds` from the connection (when shorter than `seconds`), and
    at most HEADER_BYTES are read; then it is `seconds` from the connection, plus the time the request waited for
    its turn. TimeoutError says what ran out, `why` keeps it and `code` is the answer's status (408, or 431 for
    headers too long)."""

    def __init__(self, sock, read_timeout: float, seconds: float, header_seconds: float = math.inf):
        self.sock, self.read_timeout, self.seconds, self.code = sock, read_timeout, seconds, 408
        self.started, self.why = time.monotonic(), None
        self.limit = min(seconds, header_seconds)
        self.deadline, self.allowed = self.started + self.limit, HEADER_BYTES
        self.phase = "headers did not arrive whole" if header_seconds < seconds else "did not arrive whole"
        self.flag = "the header timeout" if header_seconds < seconds else "--request-deadline"

    def headers_in(self, waited: float) -> None:
        """The headers have ended: from now on the request's own deadline holds, the wait for a turn not counted."""
        self.limit, self.allowed = self.seconds, math.inf
        self.deadline = self.started + self.seconds + waited
        self.phase, self.flag = "did not arrive whole", "--request-deadline"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.allowed <= 0:
            self.why, self.code = f"headers ran past {HEADER_BYTES:,} bytes", 431
            raise TimeoutError(self.why)
        left = self.deadline - time.monotonic()
        if left > 0:
            self.sock.settimeout(min(self.read_timeout, left))
            try:
                view = memoryview(buffer)
                n = self.sock.recv_into(view[: min(len(view), self.allowed)])
                self.allowed -= n
                return n
            except TimeoutError:
                pass
        if left <= self.read_timeout:
            self.why = f"{self.phase} within {self.limit:g} s ({self.flag})"
        else:
            self.why = f"stopped arriving for {self.read_timeout:g} s"
        raise TimeoutError(self.why)


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection. A request takes one of `max_connections` turns once its headers are in
    (reading its body, decoding, scoring: what costs memory), waiting for one up to the read timeout (else 503,
    Retry-After: 1: serve()'s handler); a connection still sending its headers holds no turn, only its thread and at most
    HEADER_BYTES, and its headers have a deadline of their own. OPEN_PER_TURN x max_connections connections may be
    open at once: one more is answered 503 at once and closed. A client that stalls holds its own thread until its
    deadline, no one else's, and never keeps the process from exiting."""

    daemon_threads = True
    # connections the kernel holds until the server accepts them: a burst of clients at once waits there instead of
    # being dropped or reset, as past socketserver's 5
    request_queue_size = 128

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self.max_connections, self.max_open = max_connections, OPEN_PER_TURN * max_connections
        self.open, self.counting, self.turns = 0, threading.Lock(), threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        with self.counting:
            full = self.open >= self.max_open
            self.open += not full
        if not full:
            return super().process_request(request, client_address)
        data = json.dumps(
            {"error": f"{self.max_open} connections open at once already ({OPEN_PER_TURN} x --max-connections)"}
        )
        head = f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        try:
            request.settimeout(1.0)
            request.sendall(f"{head}Retry-After: 1\r\nConnection: close\r\n\r\n{data}".encode())
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.counting:
                self.open -= 1

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
    *,
    max_prompt_chars: int = 2000,
    max_connections: int = 8,
    request_deadline: float = 60.0,
    header_timeout: float = 5.0,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving: call .serve_forever()) for the rewards `names`, scoring with
    score(name, images, prompts). GET /health -> {"rewards": names}; POST /score {"reward", "prompts", "images"} ->
    {"scores"}. Only that JSON is read (nothing unpickled, no paths). Each connection is read on its own thread; its
    request line and headers must arrive whole within `header_timeout` seconds of its connection (at most
    HEADER_BYTES), and then the request takes one of `max_connections` turns (body, decoding, scoring), waiting up to
    `read_timeout` for one; the request must arrive whole within `request_deadline` seconds of its connection, not
    counting that wait, and no read may wait more than `read_timeout`. A connection sending its headers holds no
    turn: a client that stalls there locks no one out. Two requests at once are parsed and decoded, and one scored (one model
    on one device): memory is bounded by the caps (docs/models.md gives the figure).

    Anything else is answered {"error": reason}, and the server goes on: 400 a malformed request (Content-Length,
    JSON, fields, a prompt that is not text, an image that is not a readable PNG or does not fit its shape), 401 a
    missing or wrong token, 404 another path, 408 a request that stops arriving or is not whole by its deadline, 411
    no Content-Length, 413 a body over `max_mb`, images over `max_pixels` (each image, and all of a request together;
    read from the PNG headers, before decoding) or a prompt over `max_prompt_chars`, 415 a body that is not
    application/json, 422 the reward's own refusal (a ValueError, e.g. the verifier given a prompt that is not
    ShapesBench's), 431 headers over HEADER_BYTES, 500 any other failure of the reward (its type and first line; its
    traceback on stderr), 503 (Retry-After: 1) a request that found no turn within `read_timeout`, or a connection
    over OPEN_PER_TURN x `max_connections` open at once."""
    scoring, decoding = threading.Lock(), threading.BoundedSemaphore(2)
    max_bytes = int(max_mb * 1e6)
    expected = None if token is None else token.encode()  # compared as bytes: the client sends it UTF-8 encoded

    class Handler(BaseHTTPRequestHandler):
        def setup(self):
            super().setup()
            self.reader = _DeadlineReader(self.connection, read_timeout, request_deadline, header_timeout)
            self.rfile, self.answered, self.turn = io.BufferedReader(self.reader, 1 << 16), False, False

        def handle_one_request(self):
            try:
                super().handle_one_request()  # a timeout while reading the request line or headers ends it unanswered
            finally:
                if self.turn:
                    self.server.turns.release()
                    self.turn = False
            if self.reader.why and not self.answered:
                # there may be no request line: what send_response reads of it
                self.request_version, self.command, self.requestline = self.protocol_version, "", ""
                self._send(self.reader.code, {"error": f"the request {self.reader.why}"})

        def parse_request(self) -> bool:
            if not super().parse_request():  # the headers, read under their own deadline; False: answered
                return False
            waiting = time.monotonic()
            self.turn = self.server.turns.acquire(timeout=read_timeout)
            if not self.turn:
                busy = f"no turn within {read_timeout:g} s: {self.server.max_connections} requests at once already"
                self._send(503, {"error": f"{busy} (--max-connections)"}, {"Retry-After": "1"})
                return False
            self.reader.headers_in(time.monotonic() - waiting)
            return True

        def _send(self, code: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.connection.settimeout(read_timeout)  # the reads may have left it at the deadline's last moment
            self.answered = True
            self.send_response(code)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code, message=None, explain=None):
            # http.server's own refusals (a malformed request line or header, another method): JSON as well
            self._send(code, {"error": message or self.responses.get(code, ("refused",))[0]})

        def _answer(self, handle: Callable[[], dict]) -> None:
            """200 and handle()'s answer, or the _Failed code and reason. After a refusal, the body left unread
            (up to twice the cap, within the request's deadline) is read and dropped, so that a client still
            sending it reads the answer instead of a reset connection; beyond that the connection is closed under
            it."""
            values = self.headers.get_all("Content-Length") or []
            framed = len(values) == 1 and re.fullmatch(r"[0-9]{1,15}", values[0].strip()) is not None
            self.unread = int(values[0]) if framed and "Transfer-Encoding" not in self.headers else None
            try:
                answer = handle()
            except _Failed as e:
                self._send(e.code, {"error": e.reason})
            except OSError:  # the client went: no one to answer
                raise
            except Exception as e:  # a bug here: an answer with a body all the same, and the trace for the operator
                traceback.print_exc()
                return self._send(500, {"error": f"the server failed: {type(e).__name__}: {str(e)[:200]}"})
            else:
                return self._send(200, answer)
            left = self.unread or 0
            if left <= 2 * max_bytes:
                try:
                    while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                        left -= len(chunk)
                except OSError:  # the client went, stalled or ran past the deadline: the connection closes
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
            except TimeoutError as e:
                self.unread = None  # the socket reads no more after a timeout
                raise _Failed(408, f"the body {e}") from None
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
            with decoding:
                name, prompts, images = parse_request(raw, names, max_batch, max_pixels, max_prompt_chars)
                del raw
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

    return _Server((host, port), Handler, max_connections)
