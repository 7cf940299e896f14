"""Network addresses and HTTP framing, shared by strategies, the proxy and serve.

address   --listen / --upstream / URL parsing and resolving
framing   where HTTP/1.1 messages begin and end in a byte stream
"""
