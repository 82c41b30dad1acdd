"""OpenAI's Predicted Outputs on /v1/chat/completions (`prediction`), with the openai SDK against the served
tiny pair: the answer is the same with any prediction; a prediction of the answer itself takes fewer target
passes; usage reports the prediction's accepted and rejected tokens; a prediction of another type is a 400."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Rewrite the file."}]


def create(client: openai.OpenAI, model_id: str, **kwargs):
    return client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_a_prediction_of_the_answer_takes_fewer_passes_and_changes_nothing(client, model_id) -> None:
    plain = create(client, model_id)
    answer = plain.choices[0].message.content
    predicted = create(client, model_id, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    assert predicted.timings["target_passes"] < plain.timings["target_passes"], (predicted.timings, plain.timings)
    details = predicted.usage.completion_tokens_details
    # the tiny model's random tokens do not all survive decoding and encoding again: some of it is rejected
    assert 0 < details.accepted_prediction_tokens <= predicted.usage.completion_tokens
    assert details.rejected_prediction_tokens >= 0
    parts = create(client, model_id, prediction={"type": "content", "content": [{"type": "text", "text": answer}]})
    assert parts.choices[0].message.content == answer
    wrong = create(client, model_id, prediction={"type": "content", "content": "nothing like it " * 8})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in create(
        client, model_id, prediction={"type": "content", "content": answer}, stream=True) if chunk.choices)
    assert streamed == answer


def test_a_prediction_of_another_type_is_a_400(client, model_id) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, model_id, prediction={"type": "file", "content": "x"})
    assert "prediction" in str(caught.value)


def test_a_prediction_longer_than_the_context_could_hold_is_a_400(client, model_id) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, model_id, prediction={"type": "content", "content": "word " * 200_000})
    assert caught.value.body["param"] == "prediction"
