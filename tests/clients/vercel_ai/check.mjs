// The Vercel AI SDK's default OpenAI provider (`openai(id)`: the Responses API) against a running server.
// Usage: node check.mjs BASE_URL MODEL_ID   (BASE_URL like http://127.0.0.1:8000/v1)
// Prints one JSON object per case: text, streamed text, a forced tool call, and the tool result round trip.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, streamText, tool } from "ai";

const [baseURL, modelId] = process.argv.slice(2);
const openai = createOpenAI({ baseURL, apiKey: "unused" });
const model = openai(modelId);
const show = (value) => console.log(JSON.stringify(value));

const text = await generateText({ model, prompt: "Say hello.", maxOutputTokens: 24, temperature: 0 });
show({ case: "generateText", text: text.text, finishReason: text.finishReason, usage: text.usage });

const stream = streamText({ model, prompt: "Say hello.", maxOutputTokens: 24, temperature: 0 });
const deltas = [];
for await (const delta of stream.textStream) deltas.push(delta);
show({ case: "streamText", deltas, text: await stream.text, finishReason: await stream.finishReason });

const weather = tool({
  description: "The weather in a city.",
  inputSchema: jsonSchema({
    type: "object",
    properties: { city: { type: "string", pattern: "^[A-Za-z /_]{1,16}$" }, unit: { type: "string", enum: ["c", "f"] } },
    required: ["city", "unit"],
    additionalProperties: false,
  }),
});
const called = await generateText({
  model, prompt: "What is the weather in Paris?", tools: { get_weather: weather }, toolChoice: "required",
  maxOutputTokens: 300, temperature: 0, providerOptions: { openai: { parallelToolCalls: false } },
});
show({ case: "toolCall", finishReason: called.finishReason,
       toolCalls: called.toolCalls.map((call) => ({ toolName: call.toolName, toolCallId: call.toolCallId, input: call.input })) });

const call = called.toolCalls[0];
const answer = await generateText({
  model, tools: { get_weather: weather }, maxOutputTokens: 24, temperature: 0,
  messages: [
    { role: "user", content: "What is the weather in Paris?" },
    { role: "assistant", content: [{ type: "tool-call", toolCallId: call.toolCallId, toolName: call.toolName, input: call.input }] },
    { role: "tool", content: [{ type: "tool-result", toolCallId: call.toolCallId, toolName: call.toolName,
                                output: { type: "text", value: "21 C, sunny" } }] },
  ],
});
show({ case: "toolResult", text: answer.text, finishReason: answer.finishReason, responseId: answer.response.id });
