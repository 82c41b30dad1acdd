"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path (the
anthropic SDKs and Claude Code use it).

request.py (body -> chat completion request), output.py (message object, content blocks, stream
events), routes.py (the endpoints, errors in Anthropic's shape).
"""
