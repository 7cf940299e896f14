/*
 * record.c: calls that name a buffer, translated to the driver's buffer of the
 * moment. Descriptor writes that name one are kept, per set, and written again after
 * a restore (a program such as llama.cpp writes a set once and binds it for ever).
 * Command buffers are followed through their states: one recorded over the program's
 * buffers and not reset names buffers a release destroys, so no release is made
 * while one exists (record_busy).
 */
#include "vklayer.h"

/* ---- descriptor sets --------------------------------------------------------- */

struct entry {
	uint32_t binding, element;
	VkDescriptorType type;
	struct vbuf *buf;
	VkDeviceSize offset, range;
};

/* A layout's bindings and their descriptor counts, in binding order. */
struct counts {
	uint32_t binding, count;
};

struct dset {
	VkDescriptorSet set;
	VkDescriptorPool pool;
	struct vdev *d;
	struct entry *e;
	uint32_t n, cap;
	struct counts *layout; /* its layout's, copied; NULL: not known */
	uint32_t nlayout;
	struct dset *next;
};

#define BUCKETS 4096
static struct dset *sets[BUCKETS];

static size_t slot(uint64_t h)
{
	return (size_t)((h * 0x9E3779B97F4A7C15ull) >> 52);
}

/* With `mu`: the set's record, made where `make`. */
static struct dset *set_of(VkDescriptorSet set, int make)
{
	struct dset **head = &sets[slot((uint64_t)(uintptr_t)set)];
	for (struct dset *s = *head; s; s = s->next)
		if (s->set == set)
			return s;
	if (!make)
		return NULL;
	struct dset *s = calloc(1, sizeof *s);
	if (s) {
		s->set = set;
		s->next = *head;
		*head = s;
	}
	return s;
}

static void drop_set(struct dset *gone)
{
	struct dset **head = &sets[slot((uint64_t)(uintptr_t)gone->set)];
	for (struct dset **p = head; *p; p = &(*p)->next)
		if (*p == gone) {
			*p = gone->next;
			break;
		}
	free(gone->e);
	free(gone->layout);
	free(gone);
}

/* ---- layouts: a write of several descriptors runs on into the next bindings once
 * one is full (llama.cpp writes all of a set's in one): each descriptor's binding is
 * found from the set's layout. ------------------------------------------------------ */

struct layout {
	VkDescriptorSetLayout handle;
	struct counts *c;
	uint32_t n;
	struct layout *next;
};

static struct layout *layouts;

static VKAPI_ATTR VkResult VKAPI_CALL create_layout(VkDevice dev,
						    const VkDescriptorSetLayoutCreateInfo *ci,
						    const VkAllocationCallbacks *alloc,
						    VkDescriptorSetLayout *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->CreateDescriptorSetLayout(dev, ci, alloc, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	struct layout *l = calloc(1, sizeof *l);
	if (l && ci->bindingCount && !(l->c = malloc(sizeof *l->c * ci->bindingCount)))
		free(l), l = NULL;
	for (uint32_t k = 0; l && k < ci->bindingCount; k++) { /* sorted as they come */
		struct counts c = {ci->pBindings[k].binding, ci->pBindings[k].descriptorCount};
		uint32_t at = l->n++;
		for (; at > 0 && l->c[at - 1].binding > c.binding; at--)
			l->c[at] = l->c[at - 1];
		l->c[at] = c;
	}
	pthread_mutex_lock(&mu);
	if (l)
		l->handle = *out, l->next = layouts, layouts = l;
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_layout(VkDevice dev, VkDescriptorSetLayout layout,
						 const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	pthread_mutex_lock(&mu);
	for (struct layout **p = &layouts; is_ours(d) && layout && *p; p = &(*p)->next)
		if ((*p)->handle == layout) {
			struct layout *gone = *p;
			*p = gone->next;
			free(gone->c), free(gone);
			break;
		}
	pthread_mutex_unlock(&mu);
	d->DestroyDescriptorSetLayout(dev, layout, alloc);
}

/* With `mu`: the set takes a copy of its layout's counts. */
static void laid_out(struct dset *s, VkDescriptorSetLayout layout)
{
	free(s->layout);
	s->layout = NULL, s->nlayout = 0;
	struct layout *l = layouts;
	while (l && l->handle != layout)
		l = l->next;
	if (l && l->n && (s->layout = malloc(sizeof *l->c * l->n))) {
		memcpy(s->layout, l->c, sizeof *l->c * l->n);
		s->nlayout = l->n;
	}
}

/* The descriptor at (`*binding`, `*element`) of a write, run on to the next binding
 * where this one is full. */
static void run_on(const struct dset *s, uint32_t *binding, uint32_t *element)
{
	uint32_t k = 0;
	while (s && k < s->nlayout && s->layout[k].binding < *binding)
		k++;
	if (!s || k == s->nlayout || s->layout[k].binding != *binding)
		return; /* not known: as it says */
	while (*element >= s->layout[k].count && k + 1 < s->nlayout)
		k++, *element = 0;
	*binding = s->layout[k].binding;
}

static int is_buffer_type(VkDescriptorType t)
{
	return t == VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER || t == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER ||
	       t == VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER_DYNAMIC ||
	       t == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC;
}

/* With `mu`: the set's descriptor (binding, element) names `e` now (its buffer NULL:
 * nothing of ours). */
static void remember(struct dset *s, const struct entry *e)
{
	for (uint32_t k = 0; k < s->n; k++)
		if (s->e[k].binding == e->binding && s->e[k].element == e->element) {
			s->e[k] = *e;
			return;
		}
	if (!e->buf)
		return;
	if (s->n == s->cap) {
		uint32_t cap = s->cap ? 2 * s->cap : 8;
		struct entry *grown = realloc(s->e, sizeof *grown * cap);
		if (!grown) {
			refuse("out of host memory for its descriptor writes");
			return;
		}
		s->e = grown, s->cap = cap;
	}
	s->e[s->n++] = *e;
}

/* Each buffer write of `w`, the driver's buffers in `infos` (w's count long). */
static void translate_write(struct dset *s, const VkWriteDescriptorSet *w,
			    VkDescriptorBufferInfo *infos)
{
	uint32_t binding = w->dstBinding, element = w->dstArrayElement;
	for (uint32_t k = 0; k < w->descriptorCount; k++, element++) {
		const VkDescriptorBufferInfo *in = &w->pBufferInfo[k];
		run_on(s, &binding, &element);
		struct entry e = {binding, element, w->descriptorType, (struct vbuf *)in->buffer,
				  in->offset, in->range};
		infos[k] = *in;
		infos[k].buffer = real_buf(in->buffer);
		if (s)
			remember(s, &e);
	}
}

static void copy_entries(const VkCopyDescriptorSet *c)
{
	struct dset *from = set_of(c->srcSet, 0), *to = set_of(c->dstSet, 1);
	for (uint32_t k = 0; to && k < c->descriptorCount; k++) {
		struct entry e = {c->dstBinding, c->dstArrayElement + k, 0, NULL, 0, 0};
		for (uint32_t i = 0; from && i < from->n; i++)
			if (from->e[i].binding == c->srcBinding &&
			    from->e[i].element == c->srcArrayElement + k)
				e.type = from->e[i].type, e.buf = from->e[i].buf,
				e.offset = from->e[i].offset, e.range = from->e[i].range;
		remember(to, &e);
	}
}

static VKAPI_ATTR void VKAPI_CALL update_sets(VkDevice dev, uint32_t nw,
					      const VkWriteDescriptorSet *w, uint32_t nc,
					      const VkCopyDescriptorSet *c)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d)) {
		d->UpdateDescriptorSets(dev, nw, w, nc, c);
		return;
	}
	size_t total = 0;
	for (uint32_t k = 0; k < nw; k++)
		if (is_buffer_type(w[k].descriptorType))
			total += w[k].descriptorCount;
	VkWriteDescriptorSet *writes = malloc(sizeof *writes * (nw ? nw : 1));
	VkDescriptorBufferInfo *infos = malloc(sizeof *infos * (total ? total : 1));
	if (!writes || !infos) {
		free(writes), free(infos);
		refuse("out of host memory for its descriptor writes");
		return;
	}
	gate_enter();
	pthread_mutex_lock(&mu);
	size_t at = 0;
	for (uint32_t k = 0; k < nw; k++) {
		writes[k] = w[k];
		if (!is_buffer_type(w[k].descriptorType))
			continue;
		struct dset *s = set_of(w[k].dstSet, 1);
		if (s)
			s->d = d;
		translate_write(s, &w[k], infos + at);
		writes[k].pBufferInfo = infos + at;
		at += w[k].descriptorCount;
	}
	for (uint32_t k = 0; k < nc; k++)
		copy_entries(&c[k]);
	d->UpdateDescriptorSets(dev, nw, writes, nc, c);
	pthread_mutex_unlock(&mu);
	gate_leave();
	free(writes), free(infos);
}

static VKAPI_ATTR VkResult VKAPI_CALL allocate_sets(VkDevice dev,
						    const VkDescriptorSetAllocateInfo *info,
						    VkDescriptorSet *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->AllocateDescriptorSets(dev, info, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < info->descriptorSetCount; k++) {
		struct dset *s = set_of(out[k], 1);
		if (s) {
			s->pool = info->descriptorPool, s->d = d;
			s->n = 0; /* a handle used before, freed with its pool */
			laid_out(s, info->pSetLayouts[k]);
		}
	}
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL free_sets(VkDevice dev, VkDescriptorPool pool, uint32_t n,
						const VkDescriptorSet *set)
{
	struct vdev *d = dev_of(dev);
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; is_ours(d) && k < n; k++) {
		struct dset *s = set ? set_of(set[k], 0) : NULL;
		if (s)
			drop_set(s);
	}
	pthread_mutex_unlock(&mu);
	return d->FreeDescriptorSets(dev, pool, n, set);
}

static void drop_pool(VkDescriptorPool pool)
{
	pthread_mutex_lock(&mu);
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b], *next; s; s = next) {
			next = s->next;
			if (s->pool == pool)
				drop_set(s);
		}
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL reset_pool(VkDevice dev, VkDescriptorPool pool,
						 VkDescriptorPoolResetFlags flags)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d))
		drop_pool(pool);
	return d->ResetDescriptorPool(dev, pool, flags);
}

static VKAPI_ATTR void VKAPI_CALL destroy_set_pool(VkDevice dev, VkDescriptorPool pool,
						   const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d) && pool)
		drop_pool(pool);
	d->DestroyDescriptorPool(dev, pool, alloc);
}

/* With `mu`, after a restore: each kept write written again with the buffer of now. */
void record_rewrite(void)
{
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b]; s; s = s->next)
			for (uint32_t k = 0; k < s->n; k++) {
				struct entry *e = &s->e[k];
				if (!e->buf || !s->d || s->d->passive)
					continue;
				VkDescriptorBufferInfo info = {e->buf->real, e->offset, e->range};
				VkWriteDescriptorSet w = {
					.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
					.dstSet = s->set, .dstBinding = e->binding,
					.dstArrayElement = e->element, .descriptorCount = 1,
					.descriptorType = e->type, .pBufferInfo = &info};
				s->d->UpdateDescriptorSets(s->d->dev, 1, &w, 0, NULL);
			}
}

/* With `mu`, at a submit (writes.c): the memory under each storage buffer that the
 * set names at `binding` (UINT32_MAX: at any) counts as written. */
void record_mark_written(VkDescriptorSet set, uint32_t binding)
{
	struct dset *s = set_of(set, 0);
	for (uint32_t k = 0; s && k < s->n; k++) {
		struct entry *e = &s->e[k];
		if ((binding == UINT32_MAX || e->binding == binding) && e->buf && e->buf->mem &&
		    (e->type == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER ||
		     e->type == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC))
			e->buf->mem->written = 1;
	}
}

/* A buffer destroyed: the writes that named it name nothing of ours any more. */
void record_forget_buffer(struct vbuf *gone)
{
	pthread_mutex_lock(&mu);
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b]; s; s = s->next)
			for (uint32_t k = 0; k < s->n; k++)
				if (s->e[k].buf == gone)
					s->e[k].buf = NULL;
	pthread_mutex_unlock(&mu);
}

void sets_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct {
		const char *name;
		PFN_vkVoidFunction fn;
	} hooks[] = {
#define HOOK(n, f) {"vk" #n, (PFN_vkVoidFunction)f}
		HOOK(UpdateDescriptorSets, update_sets),
		HOOK(AllocateDescriptorSets, allocate_sets),
		HOOK(FreeDescriptorSets, free_sets),
		HOOK(ResetDescriptorPool, reset_pool),
		HOOK(DestroyDescriptorPool, destroy_set_pool),
		HOOK(CreateDescriptorSetLayout, create_layout),
		HOOK(DestroyDescriptorSetLayout, destroy_layout),
#undef HOOK
	};
	for (size_t k = 0; k < sizeof hooks / sizeof *hooks; k++)
		if (!strcmp(hooks[k].name, name))
			*fn = hooks[k].fn;
}
