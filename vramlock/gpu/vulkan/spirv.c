/*
 * spirv.c: which descriptor bindings a shader module may write, read from its SPIR-V
 * when the program makes it. A binding is read-only when its variable is a uniform
 * buffer, or a storage buffer (or storage image, texel buffer) decorated NonWritable,
 * or whose block's members all are (GLSL's `readonly` gives the latter). Anything not
 * shown read-only is taken as written; a module that cannot be read (not SPIR-V,
 * truncated, decoration groups) writes every binding.
 */
#include "vklayer.h"

enum {
	OP_TYPE_IMAGE = 25, OP_TYPE_ARRAY = 28, OP_TYPE_RUNTIME_ARRAY = 29,
	OP_TYPE_STRUCT = 30, OP_TYPE_POINTER = 32, OP_VARIABLE = 59, OP_DECORATE = 71,
	OP_MEMBER_DECORATE = 72, OP_DECORATION_GROUP = 73, OP_GROUP_DECORATE = 74,
	OP_GROUP_MEMBER_DECORATE = 75,
};
enum { DEC_BUFFER_BLOCK = 3, DEC_NON_WRITABLE = 24, DEC_BINDING = 33, DEC_SET = 34 };
enum { SC_UNIFORM_CONSTANT = 0, SC_UNIFORM = 2, SC_STORAGE_BUFFER = 12 };
#define F_NON_WRITABLE 1u
#define F_BUFFER_BLOCK 2u
#define F_SET 4u
#define F_BINDING 8u
#define MAX_IDS (1u << 22)

/* What one pass over the module learnt, per id. */
struct ids {
	uint32_t bound;
	uint32_t *op, *a, *b;	       /* the defining instruction: opcode, two operands */
	uint32_t *flags, *set, *binding; /* decorations */
	uint32_t *members_nw;	       /* a struct's members decorated NonWritable */
	uint64_t *seen;		       /* those (struct << 32 | member), each once */
	size_t nseen;
};

static void ids_free(struct ids *t)
{
	free(t->op), free(t->a), free(t->b), free(t->flags), free(t->set), free(t->binding);
	free(t->members_nw), free(t->seen);
}

static int ids_alloc(struct ids *t, uint32_t bound)
{
	t->bound = bound;
	uint32_t **all[] = {&t->op, &t->a, &t->b, &t->flags, &t->set, &t->binding, &t->members_nw};
	int ok = 1;
	for (size_t k = 0; k < sizeof all / sizeof *all; k++)
		ok &= (*all[k] = calloc(bound, sizeof(uint32_t))) != NULL;
	return ok;
}

static void decorate(struct ids *t, const uint32_t *w, uint32_t n)
{
	if (n < 3 || w[1] >= t->bound)
		return;
	uint32_t id = w[1];
	if (w[2] == DEC_NON_WRITABLE)
		t->flags[id] |= F_NON_WRITABLE;
	else if (w[2] == DEC_BUFFER_BLOCK)
		t->flags[id] |= F_BUFFER_BLOCK;
	else if (w[2] == DEC_SET && n > 3)
		t->flags[id] |= F_SET, t->set[id] = w[3];
	else if (w[2] == DEC_BINDING && n > 3)
		t->flags[id] |= F_BINDING, t->binding[id] = w[3];
}

/* The member `member` of the struct `id` is decorated NonWritable: counted once. */
static int member_read_only(struct ids *t, uint32_t id, uint32_t member)
{
	uint64_t key = (uint64_t)id << 32 | member;
	if (id >= t->bound)
		return -1;
	for (size_t k = 0; k < t->nseen; k++)
		if (t->seen[k] == key)
			return 0;
	uint64_t *grown = realloc(t->seen, sizeof *grown * (t->nseen + 1));
	if (!grown)
		return -1;
	t->seen = grown;
	t->seen[t->nseen++] = key;
	t->members_nw[id]++;
	return 0;
}

/* One instruction of `n` words at `w`; 0, or -1: the module is beyond us. */
static int learn(struct ids *t, const uint32_t *w, uint32_t n)
{
	uint32_t op = w[0] & 0xffff;
	if (op == OP_DECORATION_GROUP || op == OP_GROUP_DECORATE || op == OP_GROUP_MEMBER_DECORATE)
		return -1;
	if (op == OP_DECORATE)
		decorate(t, w, n);
	else if (op == OP_MEMBER_DECORATE && n > 3 && w[3] == DEC_NON_WRITABLE &&
		 member_read_only(t, w[1], w[2]))
		return -1;
	uint32_t id = op == OP_VARIABLE ? (n > 2 ? w[2] : 0) : (n > 1 ? w[1] : 0);
	if (op != OP_VARIABLE && op != OP_TYPE_POINTER && op != OP_TYPE_ARRAY &&
	    op != OP_TYPE_RUNTIME_ARRAY && op != OP_TYPE_STRUCT && op != OP_TYPE_IMAGE)
		return 0;
	if (id >= t->bound || (n < 3 && op != OP_TYPE_STRUCT))
		return -1;
	t->op[id] = op;
	if (op == OP_VARIABLE) /* its pointer type, its storage class */
		t->a[id] = w[1], t->b[id] = n > 3 ? w[3] : 0;
	else if (op == OP_TYPE_POINTER) /* storage class, pointee */
		t->a[id] = w[2], t->b[id] = n > 3 ? w[3] : 0;
	else if (op == OP_TYPE_STRUCT) /* member count */
		t->a[id] = n - 2;
	else if (op == OP_TYPE_IMAGE) /* Sampled: 2 is a storage image or texel buffer */
		t->a[id] = n > 7 ? w[7] : 0;
	else /* arrays: the element */
		t->a[id] = w[2];
	return 0;
}

/* Can the variable `v` be written through? */
static int writable(const struct ids *t, uint32_t v)
{
	uint32_t ptr = t->a[v], type = ptr < t->bound ? t->b[ptr] : 0;
	for (int depth = 0; type < t->bound && depth < 8 &&
			    (t->op[type] == OP_TYPE_ARRAY || t->op[type] == OP_TYPE_RUNTIME_ARRAY);
	     depth++)
		type = t->a[type];
	if (type >= t->bound)
		return 1;
	uint32_t sc = t->b[v];
	int buffer = sc == SC_STORAGE_BUFFER ||
		     (sc == SC_UNIFORM && (t->flags[type] & F_BUFFER_BLOCK));
	int image = sc == SC_UNIFORM_CONSTANT && t->op[type] == OP_TYPE_IMAGE && t->a[type] == 2;
	if (!buffer && !image)
		return 0; /* a uniform buffer, a sampler, a sampled image, push constants... */
	if (t->flags[v] & F_NON_WRITABLE)
		return 0;
	return !(t->op[type] == OP_TYPE_STRUCT && t->a[type] > 0 &&
		 t->members_nw[type] >= t->a[type]);
}

static int add_slot(struct spv_writes *out, uint32_t set, uint32_t binding)
{
	for (uint32_t k = 0; k < out->n; k++)
		if (out->slots[k].set == set && out->slots[k].binding == binding)
			return 0;
	struct spv_slot *grown = realloc(out->slots, sizeof *grown * (out->n + 1));
	if (!grown)
		return -1;
	out->slots = grown;
	out->slots[out->n++] = (struct spv_slot){set, binding};
	return 0;
}

/* The variables written, into `out` (all set where unsure). */
static void collect(const struct ids *t, struct spv_writes *out)
{
	for (uint32_t v = 0; v < t->bound && !out->all; v++) {
		if (t->op[v] != OP_VARIABLE || !writable(t, v))
			continue;
		if ((t->flags[v] & (F_SET | F_BINDING)) != (F_SET | F_BINDING) ||
		    add_slot(out, t->set[v], t->binding[v]))
			out->all = 1;
	}
}

void spirv_writes(const uint32_t *code, size_t bytes, struct spv_writes *out)
{
	struct ids t = {0};
	size_t words = bytes / 4;
	memset(out, 0, sizeof *out);
	out->all = 1;
	if (!code || words < 5 || code[0] != 0x07230203u || code[3] == 0 || code[3] > MAX_IDS ||
	    !ids_alloc(&t, code[3])) {
		ids_free(&t);
		return;
	}
	size_t at = 5;
	while (at < words) {
		uint32_t n = code[at] >> 16;
		if (n == 0 || at + n > words || learn(&t, code + at, n))
			break;
		at += n;
	}
	if (at == words) {
		out->all = 0;
		collect(&t, out);
	}
	ids_free(&t);
}

void spirv_writes_free(struct spv_writes *w)
{
	free(w->slots);
	memset(w, 0, sizeof *w);
}
