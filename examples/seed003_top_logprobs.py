# The program of seed 003 ("Extracting Log Probabilities for Tokens"), as written, with only the model
# name changed to the bundled one. Run it against logprobe with:
#   OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python examples/seed003_top_logprobs.py
from openai import OpenAI

client = OpenAI()

response = client.chat.completions.create(
    model="smollm2-135m",
    messages=[{"role": "user", "content": "A common fruit people eat is"}],
    max_tokens=1,
    temperature=1.0,
    logprobs=True,      # Request log probabilities for generated tokens
    top_logprobs=5      # Return the top 5 most likely tokens at each position
)

print("Top token probabilities:")
try:
    # response.choices[0].logprobs.content is a list of token info objects.
    # Each token info object contains:
    #   - token: the generated token
    #   - top_logprobs: a list of alternative tokens and their logprobs
    if response.choices[0].logprobs and response.choices[0].logprobs.content:
        for token_info in response.choices[0].logprobs.content:
            print(f"\nGenerated token: {token_info.token}")
            if token_info.top_logprobs:
                for alt in token_info.top_logprobs:
                    print(f"  {alt.token} → {alt.logprob:.3f}")
    else:
        print("No token probabilities returned.")
except Exception as e:
    print(f"An error occurred: {e}")
