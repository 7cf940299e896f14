/*
 * writes.c: which of the program's memory its GPU work may have written since the
 * last restore, so that a release copies out only that (the rest has a host copy
 * that is still right). A memory counts as written when a command buffer submitted
 * (marks are made at vkQueueSubmit, from what the command buffer recorded):
 *
 *  - copies, fills or updates into a buffer bound to it (vkCmdCopyBuffer's
 *    destination, vkCmdFillBuffer, vkCmdUpdateBuffer, vkCmdCopyImageToBuffer,
 *    vkCmdCopyQueryPoolResults), or pushes it as a storage buffer descriptor;
 *  - dispatches a compute pipeline whose shaders may write a binding (spirv.c) while
 *    a descriptor set naming a buffer bound to it as a storage buffer is bound there
 *    (the set's contents are read at the submit, as the GPU will see them);
 *  - binds a descriptor set for graphics: every storage buffer it names (draws are
 *    not followed);
 *
 * or when the program maps it (table.c), or when the layer lost track (out of host
 * memory): then everything counts as written. While released no submit is made, so
 * no write escapes.
 */
#include "vklayer.h"

#define MAX_SETS 32
#define ANY UINT32_MAX /* every binding of a set */

/* ---- shader modules and pipelines: the bindings they may write ---------------- */

/* The tables are read without `mu` while commands are recorded (as cmds.c's): a
 * record dropped is unlinked at once and freed once none is being recorded. */
struct shader {
	uint64_t handle; /* a VkShaderModule or a VkPipeline */
	struct spv_writes w;
	struct shader *next;
	struct shader *dead; /* unlinked, to be freed (`graves`) */
};

#define BUCKETS 1024
static struct shader *modules[BUCKETS], *pipelines[BUCKETS];
static struct shader *graves;
static int lost; /* out of host memory once: every memory counts as written */

static size_t slot(uint64_t h)
{
	return (size_t)((h * 0x9E3779B97F4A7C15ull) >> 54);
}

void writes_forget(void)
{
	memset(modules, 0, sizeof modules);
	memset(pipelines, 0, sizeof pipelines);
	graves = NULL;
}

/* Without `mu` while recording, else with it. */
static struct shader *find(struct shader **table, uint64_t handle)
{
	struct shader *s = __atomic_load_n(&table[slot(handle)], __ATOMIC_ACQUIRE);
	while (s && s->handle != handle)
		s = __atomic_load_n(&s->next, __ATOMIC_ACQUIRE);
	return s;
}

/* With `mu`: `s` (its handle and writes set) kept in `table`. */
static void keep(struct shader **table, struct shader *s)
{
	s->next = table[slot(s->handle)];
	__atomic_store_n(&table[slot(s->handle)], s, __ATOMIC_RELEASE);
}

void writes_sweep(void)
{
	for (struct shader *s = graves, *next; s; s = next) {
		next = s->dead;
		spirv_writes_free(&s->w);
		free(s);
	}
	graves = NULL;
}

static void drop(struct shader **table, uint64_t handle)
{
	pthread_mutex_lock(&mu);
	for (struct shader **p = &table[slot(handle)]; *p; p = &(*p)->next)
		if ((*p)->handle == handle) {
			struct shader *gone = *p;
			__atomic_store_n(p, gone->next, __ATOMIC_RELEASE);
			gone->dead = graves, graves = gone; /* freed at cmds.c's next sweep */
			break;
		}
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL create_module(VkDevice dev,
						    const VkShaderModuleCreateInfo *ci,
						    const VkAllocationCallbacks *alloc,
						    VkShaderModule *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->CreateShaderModule(dev, ci, alloc, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	struct shader *s = calloc(1, sizeof *s);
	if (s) {
		s->handle = (uint64_t)(uintptr_t)*out;
		spirv_writes(ci->pCode, ci->codeSize, &s->w);
	}
	pthread_mutex_lock(&mu);
	if (s)
		keep(modules, s);
	else
		lost = 1;
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_module(VkDevice dev, VkShaderModule m,
						 const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d) && m)
		drop(modules, (uint64_t)(uintptr_t)m);
	d->DestroyShaderModule(dev, m, alloc);
}

/* With `mu`: what the stage's shader may write, added to `w`. */
static void add_stage(struct spv_writes *w, const VkPipelineShaderStageCreateInfo *st)
{
	struct shader *m = st->module ? find(modules, (uint64_t)(uintptr_t)st->module) : NULL;
	struct spv_writes inline_code = {.all = 1};
	if (!st->module) /* the code in the stage's chain (VK_KHR_maintenance5) */
		for (const VkBaseInStructure *s = st->pNext; s; s = s->pNext)
			if (s->sType == VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO) {
				const VkShaderModuleCreateInfo *ci = (const void *)s;
				spirv_writes(ci->pCode, ci->codeSize, &inline_code);
			}
	const struct spv_writes *from = m ? &m->w : &inline_code;
	w->all |= from->all;
	for (uint32_t k = 0; k < from->n && !w->all; k++) {
		struct spv_slot *grown = realloc(w->slots, sizeof *grown * (w->n + 1));
		if (!grown)
			w->all = 1;
		else
			w->slots = grown, w->slots[w->n++] = from->slots[k];
	}
	spirv_writes_free(&inline_code);
}

static VKAPI_ATTR VkResult VKAPI_CALL create_compute(VkDevice dev, VkPipelineCache cache,
						     uint32_t n,
						     const VkComputePipelineCreateInfo *ci,
						     const VkAllocationCallbacks *alloc,
						     VkPipeline *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->CreateComputePipelines(dev, cache, n, ci, alloc, out);
	if (!is_ours(d) || r < 0)
		return r;
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < n; k++) {
		struct shader *s = out[k] ? calloc(1, sizeof *s) : NULL;
		if (!s) {
			lost |= out[k] != VK_NULL_HANDLE;
			continue;
		}
		s->handle = (uint64_t)(uintptr_t)out[k];
		add_stage(&s->w, &ci[k].stage);
		keep(pipelines, s);
	}
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_pipeline(VkDevice dev, VkPipeline p,
						   const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d) && p)
		drop(pipelines, (uint64_t)(uintptr_t)p);
	d->DestroyPipeline(dev, p, alloc);
}

/* ---- command buffers: what each recorded --------------------------------------- */

struct pair {
	VkDescriptorSet set;
	uint32_t binding; /* or ANY */
};

struct cbw {
	VkCommandBuffer cb;
	struct vmem **mems; /* written by transfers and pushed descriptors */
	uint32_t nmems, capmems;
	struct pair *pairs; /* storage bindings dispatches may write, in order */
	uint32_t npairs, cappairs;
	VkPipeline compute;
	VkDescriptorSet sets[MAX_SETS]; /* bound for compute */
	int all;			/* lost track: everything written */
};

struct cbw *writes_new(void)
{
	struct cbw *c = calloc(1, sizeof *c);
	lost |= !c;
	return c;
}

void writes_free(struct cbw *c)
{
	if (c)
		free(c->mems), free(c->pairs), free(c);
}

/* With `mu`: recorded anew (or reset): it has written nothing. Its tables keep their
 * room for the next recording. */
void writes_clear(struct cbw *c)
{
	if (!c)
		return;
	c->nmems = c->npairs = 0;
	c->compute = VK_NULL_HANDLE;
	memset(c->sets, 0, sizeof c->sets);
	c->all = 0;
}

static void add_mem(struct cbw *c, struct vmem *m)
{
	for (uint32_t k = 0; k < c->nmems; k++)
		if (c->mems[k] == m)
			return;
	if (c->nmems == c->capmems) {
		uint32_t cap = c->capmems ? 2 * c->capmems : 8;
		struct vmem **grown = realloc(c->mems, sizeof *grown * cap);
		if (!grown) {
			c->all = 1;
			return;
		}
		c->mems = grown, c->capmems = cap;
	}
	c->mems[c->nmems++] = m;
}

/* A binding a dispatch may write, kept in order (the last one not kept again: a
 * program that dispatches over one set again and again); marked at the submit. A
 * list, not a set: at every dispatch of a program that binds a set of its own for each
 * (llama.cpp), looking for the pair elsewhere would cost more than marking it twice. */
static void add_pair(struct cbw *c, VkDescriptorSet set, uint32_t binding)
{
	if (!set || c->all)
		return;
	if (c->npairs && c->pairs[c->npairs - 1].set == set &&
	    c->pairs[c->npairs - 1].binding == binding)
		return;
	if (c->npairs == c->cappairs) {
		uint32_t cap = c->cappairs ? 2 * c->cappairs : 64;
		struct pair *grown = realloc(c->pairs, sizeof *grown * cap);
		if (!grown) {
			c->all = 1;
			return;
		}
		c->pairs = grown, c->cappairs = cap;
	}
	c->pairs[c->npairs++] = (struct pair){set, binding};
}

/* A command of the command buffer whose record is `c` writes into `buf` (a buffer of
 * ours, or NULL). */
void writes_buffer(struct cbw *c, VkBuffer buf)
{
	struct vbuf *b = (struct vbuf *)buf;
	if (c && b && b->mem)
		add_mem(c, b->mem);
	else if (c && b)
		c->all = 1; /* not bound yet: cannot be; be safe */
}

/* Sets bound at `point`: for compute, kept for the dispatches; for graphics, every
 * storage buffer they name counts as written. */
void writes_bind_sets(struct cbw *c, VkPipelineBindPoint point, uint32_t first, uint32_t n,
		      const VkDescriptorSet *sets)
{
	for (uint32_t k = 0; c && k < n; k++) {
		if (point != VK_PIPELINE_BIND_POINT_COMPUTE)
			add_pair(c, sets[k], ANY);
		else if (first + k < MAX_SETS)
			c->sets[first + k] = sets[k];
		else
			c->all = 1;
	}
}

/* A dispatch: the bound pipeline's written bindings in the bound sets. */
void writes_dispatch(struct cbw *c)
{
	if (!c)
		return;
	struct shader *p = c->compute ? find(pipelines, (uint64_t)(uintptr_t)c->compute) : NULL;
	if (!p || p->w.all) {
		for (uint32_t s = 0; s < MAX_SETS; s++)
			add_pair(c, c->sets[s], ANY);
		return;
	}
	for (uint32_t k = 0; k < p->w.n; k++)
		if (p->w.slots[k].set < MAX_SETS)
			add_pair(c, c->sets[p->w.slots[k].set], p->w.slots[k].binding);
}

/* With `mu`: its command buffer was submitted: what it writes counts as written. */
void writes_submitted(struct cbw *c)
{
	if (!c)
		return;
	if (c->all)
		lost = 1;
	for (uint32_t k = 0; k < c->nmems; k++)
		c->mems[k]->written = 1;
	for (uint32_t k = 0; k < c->npairs; k++)
		record_mark_written(c->pairs[k].set, c->pairs[k].binding);
}

/* With `mu`, at a release: must `m`'s contents be copied out (its host copy is not
 * known to be right)? */
int writes_since(struct vmem *m)
{
	return lost || m->written || m->mapped || !m->host;
}

/* With `mu`: every swappable memory's host copy is right (a release copied all it
 * had to). */
void writes_copied(void)
{
	lost = 0;
	for (struct vmem *m = mem_list(); m; m = m->next)
		if (m->host && table_swappable(m))
			m->written = 0;
}

void writes_bind_pipeline(struct cbw *c, VkPipeline p)
{
	if (c)
		c->compute = p;
}

void writes_execute(struct cbw *c, const struct cbw *from)
{
	for (uint32_t i = 0; c && from && i < from->nmems; i++)
		add_mem(c, from->mems[i]);
	for (uint32_t i = 0; c && from && i < from->npairs; i++)
		add_pair(c, from->pairs[i].set, from->pairs[i].binding);
	if (c && from && from->all)
		c->all = 1;
}

void writes_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(CreateShaderModule, create_module),
		HOOK(DestroyShaderModule, destroy_module),
		HOOK(CreateComputePipelines, create_compute),
		HOOK(DestroyPipeline, destroy_pipeline),
	};
	hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}
