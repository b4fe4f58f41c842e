package tokenizer

// postProcessor adds the special tokens that frame an encoded sequence.
type postProcessor interface {
	// process returns ids framed as the processor says when addSpecial is
	// set, ids unchanged otherwise.
	process(ids []int32, addSpecial bool) []int32
}

// templatePost is TemplateProcessing's single-sequence template: fixed
// special-token ids around the sequence.
type templatePost struct {
	before, after []int32
}

func (p templatePost) process(ids []int32, addSpecial bool) []int32 {
	if !addSpecial || len(p.before)+len(p.after) == 0 {
		return ids
	}
	out := make([]int32, 0, len(p.before)+len(ids)+len(p.after))
	out = append(out, p.before...)
	out = append(out, ids...)
	return append(out, p.after...)
}

// identityPost is the ByteLevel post-processor, which only trims offsets
// and so leaves the ids as they are.
type identityPost struct{}

func (identityPost) process(ids []int32, _ bool) []int32 { return ids }

// sequencePost runs post-processors one after the other.
type sequencePost []postProcessor

func (q sequencePost) process(ids []int32, addSpecial bool) []int32 {
	for _, p := range q {
		ids = p.process(ids, addSpecial)
	}
	return ids
}
