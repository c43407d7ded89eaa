"""The black-box model proxy: OpenAI and Anthropic APIs in, token ids to engines out."""
