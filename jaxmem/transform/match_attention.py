def match_attention(graph, path):
    return []
