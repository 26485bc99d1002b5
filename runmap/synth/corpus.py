"""A small English text, written for this project, that the synthetic tokenizer is trained on.

It only needs to give the byte-level BPE trainer some realistic merges (common words, punctuation,
digits, code-ish and chat-ish fragments); the synthetic models have random weights, so the text has
no influence on what they generate beyond which token strings exist.
"""

CORPUS = """\
The harbour town woke slowly. Fishing boats came in before dawn, and by seven the market was loud
with gulls, carts and people arguing about the price of mackerel. Nobody hurried; the tide decided
the day, and the tide was never late.

Write a short answer. Use exactly three bullet points. Do not use any commas in your response.
Answer in lowercase letters only. End your response with the phrase "Is there anything else?"
Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.
Respond in fewer than 120 words. Include the keywords "river", "lantern" and "winter".
Highlight at least two sections with markdown, i.e. *highlighted section*.
Wrap your entire response with double quotation marks. Give two different responses.

A mixture-of-experts layer sends each token to a few experts chosen by a router. The router scores
every expert, keeps the top k, and the layer adds the chosen experts' outputs weighted by their gate
values. Only the routed experts are compressed to four bits; attention, norms, the router and the
embeddings stay in sixteen-bit floating point.

def quantize(w, block_size=256):
    scale = w.abs().max() / 7
    q = (w / scale).round().clamp(-7, 7)
    return q, scale

for i in range(10):
    print(i, i * i, 2 ** i)

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you list three prime numbers?
Assistant: Sure: 2, 3 and 5. The next ones are 7, 11 and 13.
User: Translate "good morning" into Spanish.
Assistant: "Buenos dias."

Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 24 32 64 100 128 256 512 1000 1024 2048 4096 65504.
Dates: 2024-09-24, 2025-01-25, 12:30, 3.14159, 2.71828, 1e-5, 6.02e23.

She opened the window, and the smell of rain on warm stone filled the room. Somewhere a radio was
playing an old song about a lighthouse keeper who counted ships instead of sheep. He wrote letters he
never sent, and every winter he painted the lantern room a slightly different shade of blue.

Question: If a train leaves at 9:15 and the journey takes 2 hours and 50 minutes, when does it arrive?
Answer: It arrives at 12:05. First add two hours to get 11:15, then add fifty minutes to get 12:05.

The committee met on Tuesday. The first item was the budget; the second was the new library roof;
the third, as always, was parking. After two hours they agreed to meet again next month.

Lists, tables and code: | name | value |, - item one, - item two, 1. first, 2. second, {"key": [1, 2]}.
Punctuation test: (parentheses), [brackets], {braces}, "quotes", 'apostrophes', semicolons; colons:
dashes - and -- and ellipses... question marks? exclamation marks! slashes / back\\slashes @ # $ % & *.
"""
