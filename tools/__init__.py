"""The tools on top of the services: the `tandem` command, the local launcher, the bench,
distillation, the layer-skip search and stub generation. They may import every layer below;
nothing below imports them."""
