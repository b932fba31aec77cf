"""The HTTP face's routes, one module per API: openai.py (completions, chat, models,
tokenize), anthropic.py (Messages), responses.py (OpenAI's Responses API), admin.py
(health, metrics, version, traces). Each is a FastAPI router over the ServedModel
(server/state.py) that api.py's ``build_app`` includes."""
