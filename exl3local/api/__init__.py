"""The daemon's JSON API: the vocabulary both sides speak (protocol) and the front-ends' client."""
