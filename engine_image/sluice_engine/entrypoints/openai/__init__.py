"""The OpenAI-compatible HTTP server: routes, request models, serving, errors."""
