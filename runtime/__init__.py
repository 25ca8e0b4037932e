"""Run-time side of ssmc: the custom op every region lowers to, its autograd, and the kernel cache."""
