package main

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func newGenerateCmd() *cobra.Command {
	var (
		c        clientFlags
		req      tandemv1.GenerateRequest
		logprobs int
		asJSON   bool
		// The sampling flags, sent only when given: the model's
		// generation defaults apply to the others.
		temperature, topP float32
		topK              int32
	)
	cmd := &cobra.Command{
		Use:   "generate [PROMPT...]",
		Short: "Complete a prompt, streaming the text to the terminal",
		Long: `Send a prompt to the leader's Generate API and stream the completion to
stdout; a summary (finish reason, token counts) goes to stderr. The prompt
is the arguments joined by spaces, stdin when there are none, or token ids
with --ids. With --json, print only the final response as JSON: the whole
text, the token ids, the log-probabilities when asked (--logprobs) and the
usage.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(req.PromptTokenIds) == 0 {
				if len(args) > 0 {
					req.Prompt = strings.Join(args, " ")
				} else {
					in, err := io.ReadAll(cmd.InOrStdin())
					if err != nil {
						return fmt.Errorf("read the prompt from stdin: %w", err)
					}
					req.Prompt = string(in)
				}
			} else if len(args) > 0 {
				return errors.New("give a text prompt or --ids, not both")
			}
			if logprobs >= 0 {
				req.Logprobs = proto.Uint32(uint32(logprobs))
			}
			if cmd.Flags().Changed("temperature") {
				req.Temperature = proto.Float32(temperature)
			}
			if cmd.Flags().Changed("top-p") {
				req.TopP = proto.Float32(topP)
			}
			if cmd.Flags().Changed("top-k") {
				req.TopK = proto.Int32(topK)
			}
			conn, ctx, done, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			stream, err := tandemv1.NewInferenceClient(conn).Generate(ctx, &req)
			if err != nil {
				return fmt.Errorf("generate: %w", err)
			}
			out := cmd.OutOrStdout()
			var final tandemv1.GenerateResponse
			for {
				msg, err := stream.Recv()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					return fmt.Errorf("generate: %w", err)
				}
				if !asJSON {
					io.WriteString(out, msg.GetText())
				}
				final.Text += msg.GetText()
				final.TokenIds = append(final.TokenIds, msg.GetTokenIds()...)
				final.Logprobs = append(final.Logprobs, msg.GetLogprobs()...)
				if msg.GetUsage() != nil {
					final.FinishReason, final.Usage = msg.GetFinishReason(), msg.GetUsage()
				}
			}
			if final.Usage == nil {
				return errors.New("generate: the stream ended without its final message")
			}
			if asJSON {
				b, err := protojson.MarshalOptions{Multiline: true}.Marshal(&final)
				if err != nil {
					return err
				}
				_, err = fmt.Fprintln(out, string(b))
				return err
			}
			reason := strings.ToLower(strings.TrimPrefix(final.GetFinishReason().String(), "FINISH_REASON_"))
			fmt.Fprintln(out)
			fmt.Fprintf(cmd.ErrOrStderr(), "finish: %s; %d prompt tokens, %d generated\n", reason, final.Usage.GetPromptTokens(), final.Usage.GetCompletionTokens())
			return nil
		},
	}
	c.register(cmd.Flags())
	f := cmd.Flags()
	f.Int32SliceVar(&req.PromptTokenIds, "ids", nil, "prompt token ids (comma-separated) instead of text")
	f.Uint32Var(&req.MaxTokens, "max-tokens", 64, "most tokens to generate")
	f.Float32Var(&temperature, "temperature", 0, "sampling temperature, 0 greedy (default: the model's generation_config.json, else greedy)")
	f.Float32Var(&topP, "top-p", 0, "nucleus sampling threshold, 0 or 1 off (default: the model's, else off)")
	f.Int32Var(&topK, "top-k", 0, "sample among the k most likely tokens, 0 off (default: the model's, else off)")
	f.Uint64Var(&req.Seed, "seed", 0, "sampling seed")
	f.StringArrayVar(&req.Stop, "stop", nil, "stop when the text contains this string (repeatable)")
	f.Int32SliceVar(&req.StopTokenIds, "stop-token", nil, "stop when one of these token ids is sampled (comma-separated)")
	f.BoolVar(&req.IgnoreEos, "ignore-eos", false, "keep generating past end-of-sequence tokens")
	f.IntVar(&logprobs, "logprobs", -1, "return log-probabilities with this many alternatives per token (-1: none)")
	f.BoolVar(&asJSON, "json", false, "print the final response as JSON instead of streaming text")
	return cmd
}
