"""The prompt path: messages -> canonical prompt -> rendered tokens, breakpoints, images, constraints, the cached-prefix prediction, the turn's cache policy."""
