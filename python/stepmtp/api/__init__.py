"""OpenAI's and llama-server's request and response shapes over one engine, shared by
the server's routes and the engine's own ``create_chat_completion`` /
``create_completion``: the request models (``schemas``), a request's prompt and chat
format (``prompt``, ``chat``), its generations (``service.API``), and the responses,
whole or as stream chunks (``formats``, ``service``). Nothing here knows HTTP.
"""
