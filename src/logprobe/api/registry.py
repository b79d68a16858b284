"""The one list of the POST endpoints that run a model: each one's path, its steps (an `Endpoint` of the
pipeline, from the endpoint's own folder), its body model and whether a batch may name it. The HTTP routes
(routes.py), the OpenAPI document's request bodies, the Batch API's endpoints and file checks, and the
in-process callers (datasets, the score CLI) all read it here."""

from __future__ import annotations

from dataclasses import dataclass

from .chat import serving as chat
from .chat.protocol import ChatBody
from .checks.schema import RequestModel
from .compare import serving as comparing
from .compare import spans
from .compare.protocol import CompareBody
from .completions import serving as completions
from .completions.protocol import CompletionBody
from .responses import serving as responses
from .responses import stream as responses_stream
from .responses.protocol import ResponsesBody
from .score import serving as scoring
from .score.protocol import ScoreBody
from .serving.pipeline import Endpoint, asks_whole_vocab
from .tokenizer.protocol import DetokenizeBody, TokenizeBody
from .tree import serving as tree
from .tree.protocol import TreeBody


@dataclass(frozen=True)
class Route:
    path: str
    name: str  # the handler's name: the OpenAPI operation's id and summary
    endpoint: Endpoint
    body: type[RequestModel]
    batch: bool  # a line of a batch may name it (POST /v1/batches `endpoint`)
    description: str  # the OpenAPI operation's description


COMPLETIONS = Endpoint(completions.parse, completions.tokenize, completions.check_caps, completions.build_requests,
                       completions.format_response, completions.stream_formatters, whole_vocab=asks_whole_vocab)
CHAT = Endpoint(chat.parse, chat.tokenize, chat.check_caps, chat.build_requests, chat.format_response,
                chat.stream_formatters, whole_vocab=asks_whole_vocab)
RESPONSES = Endpoint(responses.parse, responses.tokenize, responses.check_caps, responses.build_requests,
                     responses.format_response, responses_stream.stream_formatters)
SCORE = Endpoint(scoring.parse, scoring.tokenize, scoring.check_caps, scoring.build_requests,
                 scoring.format_response)
# /v1/compare's `align: "text"`: models of any tokenizers on the spans of one text (compare/spans.py)
TEXT_SPANS = Endpoint(comparing.parse, spans.tokenize, spans.check_caps, spans.build_requests, spans.format_response,
                      resolve=comparing.resolve, jobs=comparing.jobs, format_off_loop=True)
COMPARE = Endpoint(comparing.parse, comparing.tokenize, comparing.check_caps, comparing.build_requests,
                   comparing.format_response, resolve=comparing.resolve, jobs=comparing.jobs, format_off_loop=True,
                   variant=lambda req: TEXT_SPANS if req.align == "text" else None)
TREE = Endpoint(tree.parse, tree.tokenize, tree.check_caps, tree.build_requests, tree.format_response)

ROUTES: tuple[Route, ...] = (
    Route("/v1/completions", "create_completion", COMPLETIONS, CompletionBody, True,
          "OpenAI legacy completions with log probabilities of generated tokens (`logprobs`), of the prompt "
          "(`echo` with `logprobs`, `prompt_logprobs`), and `usage` counting the BOS token."),
    Route("/v1/chat/completions", "create_chat_completion", CHAT, ChatBody, True,
          "OpenAI chat completions over the model's chat template, with `logprobs` / `top_logprobs`, "
          "streaming, and `prompt_logprobs` over the templated prompt."),
    Route("/v1/responses", "create_response", RESPONSES, ResponsesBody, True,
          "OpenAI's Responses API over the model's chat template: text or message input, `instructions`, "
          "`text.format` (structured output), the output tokens' log probabilities with `include: "
          "[\"message.output_text.logprobs\"]` and `top_logprobs`, streamed as OpenAI's events. Nothing is "
          "stored."),
    Route("/v1/score", "score", SCORE, ScoreBody, True,
          "The log-likelihood of texts you already have: per-token log probabilities, their sum, mean, "
          "perplexity and whether each token was the likeliest. No generation."),
    Route("/v1/compare", "compare", COMPARE, CompareBody, True,
          "Two served models that share a tokenizer, on the same tokens: at each position KL(p||q), KL(q||p) "
          "and Jensen-Shannon divergence (nats) of their next-token distributions, each one's likeliest token "
          "and whether they agree, and each one's log probability of the actual token. With `align: "
          "\"text\"`: two or more models of any tokenizers, each one's log probability of every span of the "
          "text where all their tokenizations have a boundary, the differences, bits per byte and the "
          "largest disagreements. No generation."),
    Route("/v1/tree", "token_tree", TREE, TreeBody, False,
          "The token tree below a prompt: each node's likeliest children to a depth, with every node's raw "
          "and processed log probability, cumulative log probability, rank and the entropy it was chosen "
          "from. The prompt runs once and each level of the tree in one pass."),
)
BY_PATH: dict[str, Route] = {route.path: route for route in ROUTES}
BATCH_PATHS: tuple[str, ...] = tuple(route.path for route in ROUTES if route.batch)
# Every POST route's body model, those of /tokenize and /detokenize (routes.py) too: the OpenAPI document's
BODIES: dict[str, type[RequestModel]] = {**{route.path: route.body for route in ROUTES},
                                         "/tokenize": TokenizeBody, "/detokenize": DetokenizeBody}


def add_request_bodies(schema: dict) -> dict:
    """Put each POST route's body model into an OpenAPI document built by FastAPI (the routes read raw
    JSON, so FastAPI sees no body of its own)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        described = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(described.pop("$defs", {}))
        components[model.__name__] = described
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema
