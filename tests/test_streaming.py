from medusa_heads.inference import GenerationStats, generate, stream
from medusa_heads.inference import heads_drafter
from medusa_heads.tree import build_tree, load_tree


def test_stream_pieces_add_up_to_the_generated_text(model, tokenizer, chat_prompts):
    drafter = heads_drafter(model, build_tree(load_tree("cpu-8")))
    whole = generate(model, tokenizer, chat_prompts[0], drafter, max_new_tokens=40)
    stats = GenerationStats()
    pieces = list(stream(model, tokenizer, chat_prompts[0], drafter, max_new_tokens=40, stats=stats))
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert stats.new_tokens == len(whole.token_ids) == 40
    assert stats.steps == whole.stats.steps and stats.accepted_lengths == whole.stats.accepted_lengths


def test_stop_string_ends_generation_at_the_token_that_completes_it(model, tokenizer, chat_prompts):
    drafter = heads_drafter(model, build_tree(load_tree("cpu-8")))
    full = generate(model, tokenizer, chat_prompts[0], drafter, max_new_tokens=60)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = generate(model, tokenizer, chat_prompts[0], drafter, max_new_tokens=60, stop_strings=[stop])
    assert stop in cut.text and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop not in tokenizer.decode(cut.token_ids[:-1])
