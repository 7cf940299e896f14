#version 450
// vk_prog's kernel with an input it writes (VK_PROG_INPUT=rw): every word of the input
// one more, then every word of the data buffer gains it. The input is not declared
// readonly: a release must copy it out every time.
layout(local_size_x = 64) in;
layout(std430, set = 0, binding = 0) buffer Data { uint words[]; };
layout(std430, set = 0, binding = 1) buffer In { uint inc[]; };
layout(push_constant) uniform Count { uint n; };
void main()
{
    uint i = gl_GlobalInvocationID.x;
    if (i < n) {
        inc[i] += 1u;
        words[i] += inc[i];
    }
}
