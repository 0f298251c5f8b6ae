"""A local OpenAI-compatible judge for the tests: a real vision-language model from transformers (LLaVA: a CLIP vision
tower, a projector, a Llama decoder) with tiny random weights, behind /v1/models and /v1/chat/completions.

Each request's PNG image goes through the vision tower and its text through the decoder, one forward. A random model
does not write "Final Score: 4" by itself, so the answer is constrained to the judge's format, as vLLM's guided
decoding would: the score is the digit 1-5 that the model's next-token logits rank highest. `delay` slows every
answer (a slow but live server); stop() closes the port (a dead one)."""

import base64
import io
import json
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from PIL import Image
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

VOCAB, IMAGE_TOKEN, SIZE, PATCH = 256, 255, 32, 8
DIGITS = [ord(str(d)) % VOCAB for d in range(1, 6)]  # the token ids of "1" ... "5"


def tiny_llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=PATCH,
    )
    text = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return LlavaForConditionalGeneration(config).eval()


def token_ids(text: str) -> list[int]:
    """A word-level tokenizer: each word's CRC32 into the vocabulary (below the image token)."""
    return [zlib.crc32(word.encode()) % (VOCAB - 1) for word in text.split()][:400]


class JSONHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible server's request handler: GET lists the model `MODEL`; replies are JSON; no access log."""

    MODEL = "judge"

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200, {"data": [{"id": self.MODEL}]})

    def log_message(self, *a):
        pass


class TinyJudge:
    def __init__(self, port: int = 0, delay: float = 0.0):
        self.model, self.delay, self.lock, self.requests = tiny_llava(), delay, threading.Lock(), 0
        judge = self

        class Handler(JSONHandler):
            MODEL = "tiny-llava"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                threading.Event().wait(judge.delay)  # not time.sleep, which tests may stub out
                self._reply(200, {"choices": [{"message": {"content": judge.answer(body["messages"][0]["content"])}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @torch.no_grad()
    def answer(self, content: list) -> str:
        image = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        text = " ".join(c["text"] for c in content if c["type"] == "text")
        png = base64.b64decode(image.split(",", 1)[1])
        pixels = torch.tensor(list(Image.open(io.BytesIO(png)).convert("RGB").getdata()), dtype=torch.float32)
        side = int(len(pixels) ** 0.5)
        x = pixels.view(1, side, side, 3).permute(0, 3, 1, 2) / 255
        x = torch.nn.functional.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True)
        ids = torch.tensor([[IMAGE_TOKEN] * (SIZE // PATCH) ** 2 + token_ids(text)])
        with self.lock:
            self.requests += 1
            logits = self.model(input_ids=ids, pixel_values=(x - 0.5) / 0.5).logits[0, -1]  # (VOCAB,)
        return f"The image is judged.\nFinal Score: {1 + int(logits[DIGITS].argmax())}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
