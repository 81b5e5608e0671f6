"""transformers' multimodal processors as the image tests call them: built without the
video processor (which needs torchvision, which the tests go without), and given one user
message of images then a question, with the generation prompt."""

from __future__ import annotations


def images_only(processor_class: type) -> type:
    """`processor_class` that accepts a processor without its video processor."""

    class Processor(processor_class):
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    return Processor


def user_message_inputs(processor, images: list, question: str, keys: tuple[str, ...]) -> dict:
    """`processor`'s tensors named `keys` for one user message of `images` then `question`,
    rendered by its chat template with the generation prompt, tokenized without special
    tokens added."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in keys}
