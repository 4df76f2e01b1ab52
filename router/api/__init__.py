"""The OpenAI-compatible API, apart from the routes themselves (router/ingress.py): request
models and their bounds, response bodies and SSE chunks, the error body, and what the
endpoints compute (prompt lists, embeddings and scores, the Responses API, tool calls,
reasoning, structured outputs, the OpenAPI schema's request bodies).

    protocol.py       request models (pydantic), sampling params from them
    limits.py         bounds on what one request may ask (400/413 before any work)
    errors.py         the OpenAI error body and APIError, with its HTTP status
    openai_format.py  completion and chat bodies, streamed chunks, logprobs, usage
    completions.py    prompt lists, fill-in-the-middle, echo, several prompts as one stream
    embeddings.py     /v1/embeddings, /v1/score, /v1/rerank bodies and the embedding fan-out
    responses.py      OpenAI's Responses API: its request, events, stored responses
    tool_calls.py     tool plans: template tools, forced calls' grammars, parsing calls
    reasoning.py      reasoning parsers (<think> blocks to reasoning_content)
    structured.py     response_format / structured_outputs to the engine's constraints
    openapi.py        /openapi.json's request bodies for routes that parse their own
"""
