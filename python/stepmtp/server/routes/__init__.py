"""One router per API family, each over the generation service (``service``):

- ``admin``: health, properties, slots, metrics and the chat page;
- ``native``: llama.cpp's own API (``/completion``, tokens, the chat template);
- ``openai``: OpenAI's models, completions and chat completions;
- ``responses``: OpenAI's Responses API;
- ``anthropic``: Anthropic's Messages API.

The last two run as chat completions in their own shapes (``converted``).
"""
