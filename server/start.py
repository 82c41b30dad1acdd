"""Submitting a parsed request to the engine: prompt ids and max tokens (server/prompt.py), the tool
plan and grammar (server/toolcalls/), sampling parameters, one `Generation` per choice. Shared by
/v1/chat/completions, /v1/completions (server/app.py) and /v1/responses (server/responses_api/).
"""

from __future__ import annotations

import dataclasses

from engine.types import Request as EngineRequest
from engine.types import SamplingParams, StructuredOutput, StructuredOutputError
from server.choices import choice_request_id, start_choices
from server.detok import TextStream
from server.errors import invalid_request
from server.generation import Generation
from server.harmony_output import HarmonyPlan, analysis_first
from server.logprobs import LogprobFormat, TokenTexts
from server.preparation import Lane, PreparationTimeout
from server.protocol import SamplingRequest
from server.reasoning import Opening, ReasoningSplitter, reasoning_first
from server.responses import Envelope
from server.state import ServerState
from server.toolcalls.plan import ToolPlan
from server.trace import StepTrace, request_method, tree_method


async def start_generations(state: ServerState, req: SamplingRequest, chat: bool, endpoint: str,
                            lane: Lane) -> tuple[list[Generation], Envelope]:
    """A parsed request's engine requests, submitted (one per choice): prompt ids and max tokens
    (server/prompt.py), tool plan, grammar, sampling parameters. Shared by /v1/responses. `lane`:
    where its template and tokenization run (server/preparation.py, chosen by the body's size)."""
    async_engine, prompt = state.require_ready()
    state.check_model(req.model)
    plan = prompt.tool_plan(req)  # None: no tool calls to read (server/toolcalls/plan.py)
    prompt_ids = await lane.run(prompt.prompt_ids, req, plan)
    max_tokens = prompt.max_tokens(req, len(prompt_ids))
    # a logit_bias of 262k entries takes a while to check: in the lane too
    params = await lane.run(req.with_defaults(state.sampling_defaults).to_sampling_params, max_tokens,
                            prompt.vocab_size)
    if plan is not None and plan.grammar is not None:  # the calls' grammar (with "auto", the reply's response_format too)
        params = dataclasses.replace(params, structured_output=plan.grammar)
    opening = prompt.reasoning_opening(req, prompt_ids)  # None: no <think> block to read apart
    if params.structured_output is not None:  # --json-whitespace; a reasoning model thinks before the grammar
        grammar = dataclasses.replace(params.structured_output, json_whitespace=state.server_config.json_whitespace)
        if grammar.reasoning is None:  # (a harmony call's grammar has its analysis block already)
            if isinstance(plan, HarmonyPlan) and plan.reasoning:  # GPT-OSS: its analysis, then the final answer
                grammar = analysis_first(grammar)
            elif opening is not None:
                grammar = reasoning_first(grammar, opening, prompt.think_tags)
        params = dataclasses.replace(params, structured_output=grammar)
    await check_structured_output(state, req, plan, params.structured_output)
    if fim_stops := prompt.stop_ids(req):  # fill-in-the-middle end markers (server/fim.py)
        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + fim_stops)
    env = Envelope(chat, state.response_model(req.model), state.fingerprint)
    texts = None if params.logprobs is None else TokenTexts(prompt.tokenizer)
    speculation = state.engine_config.speculation
    method = request_method(req.specexec, speculation)  # ours: server/trace.py
    traced = req.specexec is not None and bool(req.specexec.trace)

    drop_ids = prompt.text_drop_ids(plan, reads_reasoning=opening is not None)
    predicted = getattr(req, "prediction", None)  # chat's Predicted Outputs: a chain in every tree
    prediction_ids = None if predicted is None else await lane.run(prompt.prediction_ids, predicted.text())

    def start(index: int, choice: SamplingParams) -> Generation:
        text = TextStream(prompt.tokenizer, req.stop_strings(), drop_ids=drop_ids)
        logprobs = None if texts is None else LogprobFormat(texts, chat)
        tools = None if plan is None else plan.output(eager=bool(req.stream))
        reasoning = None if opening is None else ReasoningSplitter(inside=opening is Opening.OPENED,
                                                                   tags=prompt.think_tags)
        trace = StepTrace(prompt.tokenizer, tree_method(speculation, method, choice), drop_ids) if traced else None
        engine_request = EngineRequest(choice_request_id(env.id, index), prompt_ids, choice, method,
                                       prediction_ids=prediction_ids)
        return Generation(async_engine, engine_request, text, state.metrics, endpoint, logprobs=logprobs,
                          tools=tools, reasoning=reasoning, trace=trace)

    return start_choices(req.n or 1, params, start), env


async def check_structured_output(state: ServerState, req: SamplingRequest, plan: ToolPlan | HarmonyPlan | None = None,
                                  spec: StructuredOutput | None = None) -> None:
    """Compile the request's grammar (cached for the engine) in a grammar lane (server/preparation.py);
    one the engine cannot compile, or not within --grammar-timeout, is a 400 naming the field that asked
    for it (`tools` for the calls' grammar). `spec`: the instance the engine request carries (the engine
    keeps its compiled grammar while that instance lives); default: the request's own."""
    grammar = ("tools", plan.grammar) if plan is not None and plan.grammar is not None else req.structured_output()
    if grammar is None or state.engine is None:
        return
    param, spec = grammar[0], spec or grammar[1]
    try:
        await state.preparation.compile(state.engine.validate_structured_output, len(spec.spec), spec)
    except StructuredOutputError as exc:
        raise invalid_request(f"Invalid '{param}': {exc}.", param, "invalid_value") from None
    except PreparationTimeout:
        raise invalid_request(
            f"Invalid '{param}': the grammar took longer than {state.preparation.grammar_timeout:g} seconds to "
            "compile (--grammar-timeout). A smaller schema or regex compiles faster.",
            param, "grammar_too_complex") from None
