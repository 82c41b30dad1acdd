"""The Ollama API (`/api/*`): what Ollama-API clients (JetBrains AI Assistant, VS Code Copilot's and Zed's
Ollama providers, Open WebUI's Ollama connection, the `ollama` Python package) call.

request.py (chat and generate bodies -> chat / completion requests), models.py (the served model as
Ollama lists and shows it), routes.py (the endpoints, NDJSON streams, errors in Ollama's shape).
"""
