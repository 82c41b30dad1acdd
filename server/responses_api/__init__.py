"""`/v1/responses`: OpenAI's Responses API over the chat path (the Vercel AI SDK's default provider
and openai-python's `client.responses` use it).

request.py (body -> chat completion request), output.py (response object, output items, stream
events), store.py (stored responses), routes.py (the endpoints).
"""
