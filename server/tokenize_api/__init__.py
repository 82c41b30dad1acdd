"""`POST /tokenize` and `POST /detokenize` at the root, as llama.cpp's server and vLLM serve them.

request.py (both dialects' bodies, told apart by the text field), pieces.py (llama.cpp's `with_pieces`
pieces and `parse_special: false`), routes.py (the endpoints and their answers).
"""
